"""What both ends of the wire share: the run (its clients, trainer and gateway) and the built-in
engine (`rollouts/engine/`) import it, and it imports neither.

`generation` holds the records of a generation (`SamplingParams`, `GenerateRequest`,
`Completion`, `FinishReason`); `weight_group` the distributed weight sync's process group and
bucket format (SGLang's), the trainer's end and the built-in engine's alike; `ports` a free port.
"""
