"""The scheduler's side of structured output, with a byte-level tokenizer and no model: each plan
carries a bitmask row for exactly the structured requests that sample in it, the row allows what
the grammar allows next, and ``update_from_output`` advances the grammar, stops the request when it
is complete (here under ``ignore_eos``) and refuses a token the grammar forbids."""

import pytest
import torch

from helpers.core_helpers import fake_output, make_request, make_scheduler
from helpers.tiny_models import make_tiny_tokenizer
from micro_vllm.core.request import RequestStatus
from micro_vllm.structured_output import StructuredOutputsParams
from micro_vllm.structured_output.manager import StructuredOutputManager


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def allowed_text(bitmask: torch.Tensor, row: int, tokenizer) -> set[str]:
    """The tokens a bitmask row allows, as text."""
    words = bitmask[row].tolist()
    return {tokenizer.decode([token]) for token in range(len(tokenizer)) if words[token // 32] >> (token % 32) & 1}


def structured_scheduler(tokenizer, regex: str):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.structured_output_manager = StructuredOutputManager(
        tokenizer, len(tokenizer), max_num_seqs=8, stop_token_ids=[tokenizer.eos_token_id])
    params = StructuredOutputsParams(regex=regex)
    request = make_request(12, max_tokens=10, structured_outputs=params)  # ignore_eos
    request.grammar = scheduler.structured_output_manager.grammar_init(params)
    return scheduler, request


def test_the_plan_carries_rows_for_the_structured_requests_that_sample(tokenizer):
    scheduler, structured = structured_scheduler(tokenizer, "[0-9]{2}")
    plain = make_request(3)
    scheduler.add_request(structured)
    scheduler.add_request(plain)
    chunk = scheduler.schedule()  # the first 8 of the structured prompt's 12 tokens: nothing samples
    assert dict(chunk.num_scheduled_tokens) == {structured.request_id: 8}
    assert not chunk.structured_output_request_ids and chunk.grammar_bitmask is None
    scheduler.update_from_output(fake_output(chunk, scheduler))

    digit = tokenizer.encode("4")[0]
    for step in range(3):
        plan = scheduler.schedule()
        assert plain.request_id in plan.num_scheduled_tokens
        assert dict(plan.structured_output_request_ids) == {structured.request_id: 0}
        allowed = allowed_text(plan.grammar_bitmask, 0, tokenizer)
        assert allowed == (set("0123456789") if step < 2 else {tokenizer.eos_token})
        token = digit if step < 2 else tokenizer.eos_token_id
        finished = scheduler.update_from_output(fake_output(plan, scheduler, token))
    assert finished == [structured] and structured.status == RequestStatus.FINISHED_STOPPED
    assert structured.output_token_ids == [digit, digit, tokenizer.eos_token_id]


def test_a_token_the_grammar_forbids_is_refused(tokenizer):
    scheduler, structured = structured_scheduler(tokenizer, "[0-9]+")
    scheduler.add_request(structured)
    scheduler.update_from_output(fake_output(scheduler.schedule(), scheduler))
    with pytest.raises(RuntimeError, match=f"request '{structured.request_id}' sampled token .* its grammar forbids"):
        scheduler.update_from_output(fake_output(scheduler.schedule(), scheduler, tokenizer.encode("a")[0]))
