"""``PipelineStages.step`` keeps no outputs of the last stage beyond each
micro-batch's backward: torch's schedule would otherwise hold every
micro-batch's logits for the whole step and concatenate them into one more
copy, which ``step`` never returns."""

from __future__ import annotations

import torch
from torch import nn

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def test_a_step_returns_the_losses_and_keeps_no_last_stage_outputs() -> None:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab=64, dim=16, hidden=32, layers=2))
    with fake_mesh((1, 1), ("pp", "dp")) as mesh:
        config = fsdptx.FSDP2Config(mp_policy=None, pipeline_parallel=fsdptx.PipelineParallelConfig(microbatches=2))
        stages = fsdptx.FSDP2Manager(config, mesh).parallelize(model, loss_fn=_loss)
        assert isinstance(stages, fsdptx.PipelineStages)
        tokens = torch.randint(0, 64, (4, 8))
        losses = stages.step(inputs=tokens, target=tokens)
        assert losses is not None and len(losses) == 2
        assert all(torch.isfinite(loss) for loss in losses)
        (stage,) = stages.stages
        assert stage.output_chunks == []
