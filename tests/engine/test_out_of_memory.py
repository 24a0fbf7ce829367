"""A step that runs out of device memory ends its own requests with a clear error, and the engine
serves on: no dead replica, no blocks left held, and a prefill step that was pushing its KV mid-layers
ends that push. CPU here: the out-of-memory error is raised where a GPU would raise it, inside the
forward pass (after the first layers ran and pushed their KV), by wrapping the model's layer hook;
the rest (engines, connector, transport) is real."""

from __future__ import annotations

import time

import pytest
import torch

from bench import cuda_check
from common.config import CacheConfig, EngineConfig, EngineRole, ModelConfig, SchedulerConfig
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _run(*engines: LLMEngine, limit: int = 500) -> dict:
    """Each finished request's output, the last engine's where several finished it."""
    finished: dict = {}
    for _ in range(limit):
        if not any(e.has_unfinished_requests() for e in engines):
            break
        for engine in engines:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished


def _run_pair(prefill: LLMEngine, decode: LLMEngine, until_prefill_idle: bool = False) -> tuple[dict, dict]:
    ended: tuple[dict, dict] = ({}, {})
    deadline = time.monotonic() + 30  # KV moves on the senders' threads: steps alone do not bound it
    while time.monotonic() < deadline:
        if not prefill.has_unfinished_requests() and (until_prefill_idle or not decode.has_unfinished_requests()):
            break
        for engine, outputs in zip((prefill, decode), ended, strict=True):
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return ended


def _oom_in_a_step_longer_than(engine: LLMEngine, tokens: int, after_layer: int = 0) -> None:
    """The next forward pass of more than ``tokens`` tokens raises out-of-memory after ``after_layer``."""
    model = engine.executor.driver.model.model
    runner = engine.executor.driver
    real_execute, real_hook = runner.execute, model.layer_hook
    armed = {"now": False, "spent": False}

    def execute(step, *args, **kwargs):
        armed["now"] = len(step.input_ids) > tokens and not armed["spent"]
        return real_execute(step, *args, **kwargs)

    def hook(i, kv_cache):
        if real_hook is not None:
            real_hook(i, kv_cache)
        if armed["now"] and i == after_layer:
            armed["spent"], armed["now"] = True, False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    runner.execute = execute
    model.layer_hook = hook


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "scheduled-ahead"])
def test_the_steps_requests_end_with_the_error_and_the_engine_serves_on(tiny_dir, ahead):
    """Scheduled ahead (async scheduling), the step that runs out of memory is queued while the one
    before it is unread: that one's tokens go out, then the failed step's requests end."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_dir)),
            cache=CacheConfig(kv_cache_memory=8 << 20),
            scheduler=SchedulerConfig(async_scheduling=ahead),
        )
    )
    try:
        engine.add_request("short", list(range(10, 15)), GREEDY)
        engine.step()  # its prompt in: it decodes on, in the next steps
        _oom_in_a_step_longer_than(engine, 100)
        engine.add_request("long", list(range(10, 310)), GREEDY)
        finished = _run(engine)
        assert "out of memory computing a step" in (finished["long"].error or "")
        # The short request shared that step (a decode beside the long prompt): it ends with it.
        assert finished["short"].error == finished["long"].error
        assert engine.num_steps_out_of_memory == 1 and engine.num_blocks_held() == 0
        engine.add_request("after", list(range(10, 40)), GREEDY)
        after = _run(engine)["after"]
        assert after.error is None and len(after.outputs[0].token_ids) == 4
        assert (engine.num_steps_ahead > 0) == ahead
        engine.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("after_layer", [0, 1], ids=["after-the-first-layer", "after-the-last-layer"])
def test_a_prefill_step_out_of_memory_mid_push_ends_the_hand_off_on_both_sides(tiny_dir, after_layer):
    """After the first layer: layer 0's KV is on its way. After the last (the tiny model has two):
    every layer has left, and a "done" must still not follow (the decode side would take KV with no
    first token for a finished prompt)."""
    cpu = torch.device("cpu")
    prefill = cuda_check._engine(tiny_dir, cpu, EngineRole.PREFILL, "inproc", receive=False)
    decode = cuda_check._engine(tiny_dir, cpu, EngineRole.DECODE, "inproc", receive=True)
    try:
        assert prefill.executor.driver.shape.num_layers == 2
        _oom_in_a_step_longer_than(prefill, 0, after_layer=after_layer)

        def hand_off(request_id: str, ids: list[int]) -> None:
            ticket = cuda_check.expect_hand_off(decode, request_id, ids, GREEDY, "inproc", lease_s=30)
            prefill.add_request(request_id, ids, GREEDY, kv_ticket=ticket)

        hand_off("r0", list(range(10, 60)))
        prefilled, decoded = _run_pair(prefill, decode, until_prefill_idle=True)
        assert "out of memory" in (prefilled["r0"].error or ""), prefilled
        assert prefill.num_kv_pushes_cancelled == 1  # its push had started: cut off, no "done" sent
        # The decode side took no prompt from it (no first token, nothing decoded); its reservation
        # is the router's to cancel, as it does when a prefill fails.
        assert "r0" not in decoded and decode.has_unfinished_requests()
        decode.abort_request("r0")
        deadline = time.monotonic() + 10  # the cut-off push is reported ended: its blocks come back
        while (prefill.num_blocks_held() or decode.num_blocks_held()) and time.monotonic() < deadline:
            prefill.step()
            decode.step()
            time.sleep(0.01)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        # The next hand-off between the same engines goes through.
        hand_off("r1", list(range(10, 60)))
        prefilled, decoded = _run_pair(prefill, decode)
        assert decoded["r1"].error is None and len(decoded["r1"].outputs[0].token_ids) == 4
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
    finally:
        prefill.shutdown()
        decode.shutdown()
