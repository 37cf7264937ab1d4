"""Plug in your own generate function: a two-turn self-correction loop.

Turn 1: the model answers the prompt. Turn 2: a fixed user message asks it to check that answer,
and the model answers again. Both of the model's turns are trained (loss mask 1); the prompt, the
chat-template text between turns and the check message are not (mask 0). The reward reads only
the final answer (`metadata["response_text"]`).

    python integration_training/train.py --mode rl --config configs/smollm2-cpu.toml \
        --set rollout.generate_fn=examples.self_correct.self_correct

The held-out evaluation runs the same function with temperature 0.
"""

from __future__ import annotations

import dataclasses

from rollouts.data.sft import encode
from rollouts.rollout.protocol import GenerateContext
from rollouts.rollout.trajectory import ChatRenderer
from rollouts.types import Sample, Status
from rollouts.wire.generation import FinishReason

CHECK = "Check your answer. Reply with the final answer only."


@dataclasses.dataclass(kw_only=True, slots=True)
class _Tokens:
    """The growing token sequence of one episode, with its mask and engine logprobs."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float] = dataclasses.field(default_factory=list)  # response tokens only

    def fixed(self, ids: list[int]) -> None:
        """Text we add (template, check message): not trained; logprob placeholder 0."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def sampled(self, ids: tuple[int, ...], logprobs: tuple[float, ...]) -> None:
        """Tokens exactly as the engine sampled them: trained, with the engine's logprobs."""
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs


async def self_correct(sample: Sample, ctx: GenerateContext) -> Sample:
    """Answer, get asked to check, answer again; one Sample holding both turns."""
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        return sample  # finished in an earlier batch whose group was cut short
    tok = ctx.tokenizer
    prompt = sample.prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    renderer = ChatRenderer(tok)  # renders the conversation; returns only the new text each time
    prompt_ids = encode(tok, renderer.extend(messages, True, "prompt"))
    t = _Tokens(ids=list(prompt_ids), mask=[0] * len(prompt_ids))
    versions: list[str] = []
    answers: list[str] = []
    status = Status.COMPLETED
    for turn in range(2):
        if turn == 1:  # the check message and the next assistant header
            messages.append({"role": "user", "content": CHECK})
            t.fixed(encode(tok, renderer.extend(messages, True, "check")))
        room = min(ctx.sampling.max_new_tokens, ctx.max_total_tokens - len(t.ids))
        if room <= 0:
            status = Status.TRUNCATED
            break
        params = dataclasses.replace(ctx.sampling, max_new_tokens=room)
        out = await ctx.engine.generate(t.ids, params, rid=f"{ctx.rid}-t{turn}")
        if out.finish_reason is FinishReason.ABORT:
            # weights are being swapped: hand it back unfinished, it runs again from the prompt
            return dataclasses.replace(sample, status=Status.ABORTED)
        if out.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"engine error on turn {turn}: {out.text[:200]!r}")  # -> FAILED
        t.sampled(out.output_ids, out.logprobs)
        versions.append(out.weight_version)
        text = tok.decode(list(out.output_ids), skip_special_tokens=False)
        renderer.generated(text)
        answer = text.removesuffix(tok.eos_token or "")
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
        if out.finish_reason is FinishReason.LENGTH:
            status = Status.TRUNCATED
            break
        t.fixed(encode(tok, renderer.extend(messages, False, "answer")))  # e.g. "\n" after EOS
    return dataclasses.replace(
        sample,
        tokens=tuple(t.ids),
        loss_mask=tuple(t.mask),
        response_length=len(t.ids) - len(prompt_ids),
        rollout_logprobs=tuple(t.logprobs),
        weight_versions=tuple(versions),
        status=status,
        metadata={**sample.metadata, "response_text": (answers or [""])[-1], "answers": answers},
    )
