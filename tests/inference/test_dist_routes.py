"""The built-in server's distributed weight-update routes refuse what SGLang refuses, in its shape
(success false, HTTP 400), without touching the served weights."""

from __future__ import annotations

import httpx

from rollouts.engine.launch import EngineProcess


async def test_refusals_answer_success_false_and_sessions_pair_up(
    servers: dict[str, EngineProcess],
) -> None:
    url = servers["main"].url
    bucket = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]]}
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        no_group = await http.post("/update_weights_from_distributed", json=bucket)
        nccl_on_cpu = await http.post(
            "/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": 29999,
                "rank_offset": 1,
                "world_size": 2,
                "backend": "nccl",
            },
        )
        missing = await http.post("/init_weights_update_group", json={"master_address": "x"})
        bad_dtype = await http.post(
            "/update_weights_from_distributed", json={**bucket, "dtypes": ["complex7"]}
        )
        sessions = [
            (await http.post(path, json={})).status_code
            for path in ("/end_weight_update", "/begin_weight_update", "/begin_weight_update")
        ]
        sessions.append((await http.post("/end_weight_update", json={})).status_code)
        destroy = await http.post("/destroy_weights_update_group", json={"group_name": "nope"})
    assert no_group.status_code == 400 and no_group.json()["success"] is False
    assert "init it first" in no_group.json()["message"]
    assert nccl_on_cpu.status_code == 400 and "CUDA" in nccl_on_cpu.json()["message"]
    assert missing.status_code == 400
    assert bad_dtype.status_code == 400 and "complex7" in bad_dtype.text
    assert sessions == [400, 200, 400, 200]
    assert destroy.status_code == 400 and destroy.json()["success"] is False
