"""Logprobs and prompt logprobs against transformers (fp32, CPU): every entry's logprob is
``log_softmax`` of transformers' logits at that position within ATOL (the models' own logits
tolerance, tests/models: the two implementations differ by float32 rounding only), every rank is
exact (1 + the tokens at least as likely), the top-k tokens are transformers' top k, and the sampled
or prompt token is always there. Greedy and seeded sampling, both sampler routes, async scheduling on
and off, prompts in one chunk and in chunks of 8 tokens, DELTA streaming, the prefix cache and
preemption."""

from __future__ import annotations

import pytest
import torch

from micro_vllm import LLM, RequestOutputKind, SamplingParams
from helpers.tiny_models import load_hf_reference, make_tiny_model, make_tiny_tokenizer, one_torch_thread  # noqa: F401

ATOL = 1e-4
PROMPTS = [[256, *b"The quick brown fox jumps"], [256, *b"over the lazy"], [256, 7, 7]]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, top_k=30, seed=11, logprobs=5, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=1.0, seed=5, logprobs=0, prompt_logprobs=0, detokenize=False,
                   ignore_eos=True),
]
TOKENIZER = make_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Untied, unit-scale embeddings: peaked distributions whose top tokens are far from ties.
    return make_tiny_model("llama_untied", tmp_path_factory.mktemp("logprobs"))


@pytest.fixture(scope="module")
def reference(model_dir):
    model = load_hf_reference(model_dir)

    @torch.no_grad()
    def logprobs(token_ids: list[int]) -> torch.Tensor:
        """Row i: the log-probabilities of the token after ``token_ids[: i + 1]``."""
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)

    return logprobs


def make_llm(model_dir, **kwargs) -> LLM:
    settings = dict(device="cpu", dtype="float32", max_model_len=64, block_size=4, max_num_batched_tokens=8)
    return LLM(model=str(model_dir), **{**settings, **kwargs})


def check_position(position: dict, token_id: int, expected: torch.Tensor, num_logprobs: int, detokenize=True):
    """One position's dict against transformers' log-probabilities ``expected`` [vocab]."""
    top = expected.topk(num_logprobs).indices.tolist()
    assert token_id in position and set(position) == {token_id, *top}
    for candidate, entry in position.items():
        assert entry.logprob == pytest.approx(expected[candidate].item(), abs=ATOL)
        assert entry.rank == int((expected >= expected[candidate]).sum())
        assert entry.decoded_token == (TOKENIZER.decode([candidate]) if detokenize else None)
    assert [position[t].rank for t in top] == list(range(1, num_logprobs + 1))


def check_output(output, reference, params: SamplingParams) -> None:
    prompt, completion = output.prompt_token_ids, output.outputs[0]
    expected = reference(prompt + completion.token_ids)
    if params.logprobs is None:
        assert completion.logprobs is None and completion.cumulative_logprob is None
    else:
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (token_id, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(position, token_id, expected[len(prompt) - 1 + i], params.logprobs, params.detokenize)
        sampled = [position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs)]
        assert completion.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-4)
    if params.prompt_logprobs is None:
        assert output.prompt_logprobs is None
    else:
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        for i, position in enumerate(output.prompt_logprobs[1:], start=1):
            check_position(position, prompt[i], expected[i - 1], params.prompt_logprobs, params.detokenize)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("max_num_batched_tokens", [8, 64], ids=["chunked", "one-chunk"])
def test_logprobs_match_transformers(model_dir, reference, async_scheduling, max_num_batched_tokens):
    """A batch of greedy and seeded requests with and without (prompt) logprobs; a request that
    asks for none gets None beside them, and a one-token prompt's prompt logprobs are [None]."""
    params = [*PARAMS, SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=2, prompt_logprobs=1)]
    with make_llm(model_dir, async_scheduling=async_scheduling, max_num_batched_tokens=max_num_batched_tokens) as llm:
        outputs = llm.generate([*PROMPTS, PROMPTS[0], [256]], params, use_tqdm=False)
    for output, request_params in zip(outputs, params):
        check_output(output, reference, request_params)


def test_triton_sampler_route(model_dir, reference):
    params = SamplingParams(max_tokens=2, temperature=0.9, seed=3, logprobs=2, ignore_eos=True)
    with make_llm(model_dir, custom_ops=["none", "+sampler"]) as llm:
        assert llm.engine.executor.worker.model_runner.sampler.use_triton
        [output] = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    check_output(output, reference, params)


def test_delta_outputs_give_each_position_once(model_dir, reference):
    """DELTA outputs add up to the CUMULATIVE ones: the new tokens' logprobs each time, the prompt
    logprobs in one output only."""
    kinds = {kind: SamplingParams(max_tokens=5, temperature=0, logprobs=2, prompt_logprobs=1, ignore_eos=True,
                                  output_kind=kind) for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE)}
    with make_llm(model_dir) as llm:
        engine = llm.engine
        for kind, params in kinds.items():
            engine.add_request(kind.name, PROMPTS[0], params)
        streamed = {kind.name: [] for kind in kinds}
        while engine.has_unfinished_requests():
            for output in engine.step():
                streamed[output.request_id].append(output)
    deltas, cumulative = streamed["DELTA"], streamed["CUMULATIVE"][-1]
    check_output(cumulative, reference, kinds[RequestOutputKind.CUMULATIVE])
    assert len(deltas) == 5 and all(len(d.outputs[0].token_ids) == len(d.outputs[0].logprobs) == 1 for d in deltas)
    # Two rows of one batch: equal up to float32 rounding.
    assert_same_positions([p for d in deltas for p in d.outputs[0].logprobs], cumulative.outputs[0].logprobs)
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(cumulative.outputs[0].cumulative_logprob)
    assert deltas[0].prompt_logprobs[0] is None
    assert_same_positions(deltas[0].prompt_logprobs[1:], cumulative.prompt_logprobs[1:])
    assert all(d.prompt_logprobs == [] for d in deltas[1:])


def assert_same_positions(got: list[dict], expected: list[dict]) -> None:
    assert [list(p) for p in got] == [list(p) for p in expected]
    for position, expected_position in zip(got, expected):
        for token_id, entry in position.items():
            other = expected_position[token_id]
            assert (entry.rank, entry.decoded_token) == (other.rank, other.decoded_token)
            assert entry.logprob == pytest.approx(other.logprob, abs=ATOL)


def test_prompt_logprobs_skip_the_prefix_cache(model_dir, reference):
    """A request that asks for prompt logprobs computes its whole prompt (vLLM skips its prefix-cache
    hits); the blocks it computed serve the requests that do not ask."""
    prompt = PROMPTS[0]
    plain = SamplingParams(max_tokens=1)
    asking = SamplingParams(max_tokens=1, prompt_logprobs=1)
    with make_llm(model_dir) as llm:
        cached = [llm.generate([prompt], p, use_tqdm=False)[0] for p in (plain, asking, plain)]
    assert [o.num_cached_tokens for o in cached] == [0, 0, (len(prompt) - 1) // 4 * 4]
    check_output(cached[1], reference, asking)


def test_preempted_requests_give_their_prompt_logprobs_once(model_dir, reference):
    """A cache too small for the batch preempts requests, mid-prompt and after it, and recomputes
    them; each still gives every prompt position once, and every output token's logprobs."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    with make_llm(model_dir, num_blocks=12) as llm:
        scheduler, preempted = llm.engine.scheduler, []
        preempt = scheduler._preempt
        scheduler._preempt = lambda request: preempted.append(request.num_output_tokens) or preempt(request)
        outputs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0][::-1]], params, use_tqdm=False)
    # Some preempted mid-prompt, some after it (with output tokens).
    assert 0 in preempted and max(preempted) > 0
    for output in outputs:
        check_output(output, reference, params)


def test_a_batch_that_asks_for_no_logprobs_computes_none(model_dir, monkeypatch):
    """No log-softmax, no top-k and no copies for logprobs unless a request asks."""
    from micro_vllm.sampling import sampler
    from micro_vllm.worker import prompt_logprobs

    def refuse(*args):
        raise AssertionError("logprobs computed for a batch that asked for none")

    for module in (sampler, prompt_logprobs):
        monkeypatch.setattr(module, "compute_logprobs", refuse)
    with make_llm(model_dir) as llm:
        outputs = llm.generate(PROMPTS, [SamplingParams(max_tokens=3, temperature=t) for t in (0, 1, 0.5)],
                               use_tqdm=False)
        assert all(o.outputs[0].logprobs is None and o.prompt_logprobs is None for o in outputs)
        with pytest.raises(AssertionError, match="asked for none"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=0), use_tqdm=False)


def test_preempted_after_its_last_prompt_chunk_before_its_first_token(model_dir, reference):
    """A 9-token prompt in 8-token steps: the first step computes every token that predicts a prompt
    token, the second the last one and the first output token. Preempted between the two (as the
    scheduler preempts when the pool runs dry), the request computes its prompt again: its prompt
    logprobs still come once."""
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY)
    with make_llm(model_dir, async_scheduling=False) as llm:
        engine, scheduler = llm.engine, llm.engine.scheduler
        engine.add_request("r", PROMPTS[0][:9], params)
        assert engine.step() == [] and scheduler.requests["r"].num_computed_tokens == 8
        request = scheduler.running.pop()
        scheduler._preempt(request)
        scheduler.finished_req_ids.add("r")  # the plan's preempted ids: the runner drops its row
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    assert len(outputs) == 1 and request.num_preemptions == 1
    check_output(outputs[0], reference, params)



def test_each_token_is_decoded_once_per_engine(model_dir, reference, monkeypatch):
    """The texts of the logprobs' tokens are decoded the first time the engine meets each token: a
    second request over the same prompt decodes none. The cumulative logprob adds the sampled
    tokens' logprobs one after the other."""
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=4, prompt_logprobs=2, ignore_eos=True)
    with make_llm(model_dir) as llm:
        tokenizer, decoded = llm.engine.output_processor.tokenizer, []
        batch_decode = tokenizer.batch_decode
        monkeypatch.setattr(tokenizer, "batch_decode", lambda ids, **kwargs: decoded.extend(ids) or batch_decode(ids))
        first = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
        num_decoded = len(decoded)
        assert num_decoded > 0 and len({tuple(ids) for ids in decoded}) == num_decoded
        second = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert len(decoded) == num_decoded
    assert (second.outputs[0].logprobs, second.prompt_logprobs) == (first.outputs[0].logprobs, first.prompt_logprobs)
    check_output(first, reference, params)
    completion, total = first.outputs[0], 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        total += position[token_id].logprob
    assert completion.cumulative_logprob == total
