"""Half-precision targets and cheaper drafts: the exact-width verify and the int8 draft."""

from __future__ import annotations

import pytest
import torch
from rebuilds import stream_evicting

from specdec import SamplingParams, SpeculativeEngine
from specdec.device.calibration.candidates import Candidate, bf16_weights_candidates
from specdec.models.loading import load_model
from specdec.models.tiny import PROMPTS

GREEDY = SamplingParams(max_new_tokens=32)


@pytest.fixture(scope="module")
def bf16_engine(tiny_pair):
    draft, target = tiny_pair
    return SpeculativeEngine.from_pretrained(draft, target, dtype="bfloat16")


def test_every_dtype_pads_to_measured_exact_widths(bf16_engine, engine):
    for built in (bf16_engine, engine):
        verifier = built.transport.verifier
        calibration = verifier.calibration
        assert verifier.exact is calibration.chosen.exact is not None
        assert calibration.candidate == Candidate(str(built.target.model.dtype)[len("torch.") :])
        assert not calibration.automatic
        assert calibration.device.startswith("cpu: ")
        # One forward cost per measured width, 1 .. k_max + 1 and beyond.
        k_max = built.config.speculation.max_speculative_tokens
        assert len(calibration.chosen.forward_s) > k_max + 1
        assert all(s > 0 for s in calibration.chosen.forward_s)


class _RowsApart(torch.nn.Linear):
    """A linear layer whose kernel computes some calls' rows its own way: the middle row of an
    odd-width call (as a two-thread GEMM did with the tiny target's bfloat16 lm_head), or every
    row of a call whose width ``apart`` picks (as a GEMM with a 1-row fast path does)."""

    def __init__(self, inner: torch.nn.Linear, apart, whole: bool = False) -> None:
        torch.nn.Module.__init__(self)  # a Linear to the calibration, without new weights
        self.inner, self.apart, self.whole = inner, apart, whole
        self.weight, self.bias = inner.weight, inner.bias
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x):
        out = self.inner(x)
        width = x.shape[-2]
        if self.apart(width):
            out = out.clone()
            if self.whole:
                out += 1.0
            else:
                out[..., width // 2, :] += 1.0
        return out


def _sets(tiny_pair, apart, whole=False, max_width=8):
    from specdec.device.exact_widths import measure_exact_width_sets

    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    loaded.model.lm_head = _RowsApart(loaded.model.lm_head, apart, whole)
    generator = torch.Generator().manual_seed(0)
    return measure_exact_width_sets(loaded.model, max_width, generator=generator, elements=10_000)


def _widths(sets) -> list[int]:
    return sorted(w for s in sets for w in s)


def test_widths_whose_rows_depend_on_their_position_belong_to_no_set(tiny_pair):
    # The device's own kernels may leave widths out too (on an AVX2-only EPYC the tiny target's
    # float32 exact-width sets are [1], [2, 3], [4, 8]: 5-7 in none); the modified layer takes
    # the odd.
    device = _widths(_sets(tiny_pair, lambda width: False))
    sets = _sets(tiny_pair, lambda width: width % 2 == 1 and width > 1)
    assert _widths(sets) == [w for w in device if w == 1 or w % 2 == 0]
    assert 1 in device and 2 in device


def test_widths_that_round_apart_form_separate_sets(tiny_pair):
    # The device's own kernels may split widths too; the modified layer must add the cut at 3|4.
    device_sets = _sets(tiny_pair, lambda width: False)
    sets = _sets(tiny_pair, lambda width: width <= 3, whole=True)
    assert _widths(sets) == _widths(device_sets)
    assert all(max(s) <= 3 or min(s) >= 4 for s in sets)
    assert all(any(set(s) <= set(d) for d in device_sets) for s in sets)


@pytest.mark.parametrize("seed", range(6))
def test_the_whole_model_check_compares_the_smallest_width_in_its_first_trial(tiny_pair, seed):
    # A 1-row forward computed apart (as the bundled bfloat16 target's is on an AVX-512 BF16
    # EPYC): one trial must fail the (1, 2) set whatever the random split would have been.
    from specdec.device.exact_widths import use_row_wise_attention, whole_forward_exact

    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    use_row_wise_attention(loaded.model)  # as the calibration checks an exact-width set
    loaded.model.lm_head = _RowsApart(loaded.model.lm_head, lambda width: width == 1, whole=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        assert not whole_forward_exact(
            loaded.model, loaded.vocab_size, (1, 2), generator, max_trials=1
        )
        # Width 1 unused: the modified layer changes nothing the check sees.
        assert whole_forward_exact(loaded.model, loaded.vocab_size, (2,), generator, max_trials=1)


def test_exact_widths_pad_to_the_cheapest_width_and_chunk_past_the_widest():
    from specdec.device.calibration.results import ExactWidths

    costs = (1.0, 2.0, 3.0, 4.0, 3.5, 5.0)  # a 5-row forward is cheaper than a 4-row one
    exact = ExactWidths((2, 4, 5), costs)
    assert exact.width_for(1) == 2
    assert exact.width_for(3) == 5  # 4 fits too, but costs more
    assert exact.chunks(12) == [(5, 5), (5, 5), (2, 2)]
    assert exact.rows_seconds(12) == 3.5 + 3.5 + 2.0
    with pytest.raises(ValueError):
        ExactWidths((2,), costs).width_for(3)


def test_exact_widths_cover_rows_at_the_least_cost():
    from specdec.device.calibration.results import ExactWidths

    # Widest-first would run 6 rows as 5 + 1 (padded to 3): 5.5 + 3; two forwards of 3 cost 6.
    exact = ExactWidths((3, 5), (1.0, 1.0, 3.0, 3.0, 5.5))
    assert exact.chunks(6) == [(3, 3), (3, 3)]
    assert exact.rows_seconds(7) == 8.5  # 5 + 3 rows, against three 3-row forwards' 9
    assert exact.chunks(7)[0][0] == exact.chunks(7)[0][1]  # the padded forward last
    # A set is never priced above one of its own widths alone, whatever the (noisy) costs.
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        costs = tuple((1 + torch.rand(17, generator=generator)).cumsum(0).tolist())
        whole = ExactWidths(tuple(range(11, 18)), costs)
        for width in whole.widths:
            alone = ExactWidths((width,), costs)
            for rows in range(1, 70):
                assert whole.rows_seconds(rows) <= alone.rows_seconds(rows)
                assert sum(real for real, _ in whole.chunks(rows)) == rows


@pytest.fixture(params=["one-width", "width-sets"])
def half_engine(request):
    """The tiny pair in bfloat16: as calibrated (one exact width) and with a target whose exact
    widths form several sets (tests/width_sets.py)."""
    name = "bf16_engine" if request.param == "one-width" else "width_set_engine"
    return request.getfixturevalue(name)


@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_exact_widths_make_target_logits_independent_of_k(half_engine, k):
    # Bitwise equality of the logprobs: each position's logits come from a forward of the same
    # width whatever k is, so not even the last bit of bfloat16 rounding may differ.
    for prompt in PROMPTS:
        expected = half_engine.generate(prompt, GREEDY, 0)
        out = half_engine.generate(prompt, GREEDY, k)
        assert out.token_ids == expected.token_ids, (prompt, k)
        assert out.logprobs == expected.logprobs, (prompt, k)


def test_exact_width_padding_never_stays_in_the_cache(bf16_engine, monkeypatch):
    verifier = bf16_engine.transport.verifier
    seen = []
    original = verifier.verify_batch

    def spy(requests):
        responses = original(requests)
        for request, response in zip(requests, responses):
            entry = verifier.sessions._entries.get(request.session.session_id)
            if entry is not None:
                committed = request.session.prefix_len + len(request.session.new_token_ids)
                seen.append((len(entry.cached_ids), committed, response.num_accepted))
        return responses

    monkeypatch.setattr(verifier, "verify_batch", spy)
    bf16_engine.generate(PROMPTS[0], GREEDY, 4)
    assert seen
    # The cache holds the committed tokens plus the accepted drafts, never the padding.
    assert all(cached == committed + accepted for cached, committed, accepted in seen)


def test_int8_draft_is_quantized_and_output_stays_exact(tiny_pair):
    draft, target = tiny_pair
    engine = SpeculativeEngine.from_pretrained(draft, target, draft_dtype="int8")
    quantized = torch.ao.nn.quantized.dynamic.Linear
    assert any(isinstance(m, quantized) for m in engine.draft.model.modules())
    assert not any(isinstance(m, quantized) for m in engine.target.model.modules())
    for prompt in PROMPTS[:4]:
        expected = engine.generate(prompt, GREEDY, 0)
        out = engine.generate(prompt, GREEDY, 4)
        assert out.token_ids == expected.token_ids
        assert out.stats.accepted_tokens > 0


def test_int8_on_a_gpu_is_refused(tiny_pair):
    from specdec import ModelLoadError

    with pytest.raises(ModelLoadError, match="int8 runs on the CPU only"):
        load_model(tiny_pair[0], dtype="int8", device="cuda")


@pytest.mark.parametrize(
    "candidate", [Candidate("bfloat16"), Candidate("float32"), *bf16_weights_candidates()], ids=str
)
def test_a_rebuilt_session_continues_bitwise_as_the_uninterrupted_one(request, candidate):
    # The rebuild replays the prompt's prefill as one forward and the rest in exact widths, so
    # the rebuilt cache is bitwise the lost one: token ids and logprobs equal the undisturbed
    # run's, in half precision too (where a plain forward over the prefix changed them).
    # float32+bf16w needs weights that are bfloat16 values: the pair stored in bfloat16.
    pair = "tiny_pair_bf16" if candidate in bf16_weights_candidates() else "tiny_pair"
    draft, target = request.getfixturevalue(pair)
    built = SpeculativeEngine.from_pretrained(
        draft, target, dtype=candidate.dtype, gemm=candidate.gemm
    )
    _rebuilds_continue_bitwise(built)


def test_a_rebuilt_session_of_a_several_width_target_continues_bitwise(width_set_engine):
    # The replay pads its pieces to the widths of the set, as the lost session's forwards were.
    _rebuilds_continue_bitwise(width_set_engine)


def _rebuilds_continue_bitwise(built: SpeculativeEngine) -> None:
    verifier = built.transport.verifier
    rebuilds = verifier.sessions.rebuilds
    sides = (built.transport.proposer, verifier)
    for prompt in PROMPTS:
        expected = stream_evicting(built, prompt, GREEDY, 0, ())
        for k in (3, "auto"):
            assert stream_evicting(built, prompt, GREEDY, k, ()) == expected, (prompt, k)
            assert stream_evicting(built, prompt, GREEDY, k, sides) == expected, (
                prompt,
                k,
                "both evicted",
            )
            assert stream_evicting(built, prompt, GREEDY, k, sides[1:]) == expected, (
                prompt,
                k,
                "target evicted",
            )
        assert stream_evicting(built, prompt, GREEDY, 0, sides[1:]) == expected, (
            prompt,
            "k=0 rebuilt",
        )
    assert verifier.sessions.rebuilds > rebuilds + len(PROMPTS)


def test_without_exact_widths_no_exact_widths_are_measured(tiny_pair):
    from specdec.device.calibration.load import calibrate
    from specdec.device.exact_widths import ROW_WISE_ATTENTION

    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    model, calibration = calibrate(
        loaded,
        "target",
        [Candidate("float32")],
        max_speculative_tokens=3,
        automatic=False,
        exact_widths=False,
    )
    assert calibration.chosen.exact is None and len(calibration.chosen.forward_s) > 4
    assert model.model.config._attn_implementation != ROW_WISE_ATTENTION


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
def test_a_calibration_candidate_equals_transformers_own_load_without_copying_float32(
    tiny_pair, dtype
):
    """cast_model builds each candidate without a float32 copy of the weights (the bundled target's
    bfloat16 candidate peaked at 12.4 GB that way), and it must still be exactly the model
    transformers loads in that dtype: same logits bitwise, buffers such as the rotary
    frequencies left in float32 (Module.to would round them), tied weights still tied (but
    for int8's quantized lm_head), the float32 model untouched."""
    import copy

    from transformers import AutoModelForCausalLM

    from specdec.device.calibration.casting import cast_model
    from specdec.models.loading import quantize_int8

    model = load_model(tiny_pair[1]).model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in Qwen2.5-1.5B
    before = {name: t.clone() for name, t in model.state_dict().items()}
    if dtype == "int8":
        expected = copy.deepcopy(model)
        quantize_int8(expected)
    else:
        expected = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=getattr(torch, dtype))
        expected.lm_head.weight = expected.model.embed_tokens.weight
    assert expected.model.rotary_emb.inv_freq.dtype == torch.float32
    cast = cast_model(model, dtype)
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.inference_mode():
        assert torch.equal(cast(input_ids=ids).logits, expected(input_ids=ids).logits)
    float_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if dtype != "int8":  # int8 quantizes lm_head and shares the float embedding and norms
        assert cast.lm_head.weight is cast.model.embed_tokens.weight
        assert not float_storages & {p.untyped_storage().data_ptr() for p in cast.parameters()}
        assert all(p.dtype == getattr(torch, dtype) for p in cast.parameters())
    assert all(b.dtype == torch.float32 for b in cast.buffers() if b.is_floating_point())
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, before[name]), name


def _row_by_row(model: torch.nn.Module) -> None:
    """Every Linear layer computes each row in a call of its own: every width exact."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            layer = module.forward
            module.forward = lambda x, layer=layer: torch.cat(
                [layer(x[..., i : i + 1, :]) for i in range(x.shape[-2])], dim=-2
            )


def test_the_check_computes_rows_at_every_width_of_the_set_when_asked(tiny_pair):
    # Width 5 alone computes its rows apart. One random trial need not cut a piece of 5 rows;
    # rows_per_width makes every narrower width compute at least that many rows.
    from specdec.device.exact_widths import use_row_wise_attention, whole_forward_exact

    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    use_row_wise_attention(loaded.model)
    _row_by_row(loaded.model)
    widths = tuple(range(2, 9))
    with torch.inference_mode():
        generator = torch.Generator().manual_seed(0)
        args = (loaded.model, loaded.vocab_size, widths, generator)
        assert whole_forward_exact(*args, rows_per_width=8)
        loaded.model.lm_head = _RowsApart(loaded.model.lm_head, lambda w: w == 5, whole=True)
        for seed in range(3):
            generator.manual_seed(seed)
            assert not whole_forward_exact(*args, max_trials=1, rows_per_width=1)


def _meta_model(shapes: dict[tuple[int, int], int]) -> torch.nn.Module:
    """Linear layers of (out_features, in_features) shapes, each used ``count`` times."""
    layers = [
        torch.nn.Linear(inputs, outputs, bias=False, device="meta")
        for (outputs, inputs), count in shapes.items()
        for _ in range(count)
    ]
    return torch.nn.Sequential(*layers)


def test_a_half_precision_set_is_checked_only_where_a_split_would_show(tiny_pair):
    from specdec.device.calibration.measure import HALF_SET_MAX_PASSES
    from specdec.device.exact_widths import half_precision_rows

    budget = HALF_SET_MAX_PASSES * 17  # rows a width, k_max 12
    # Qwen2.5 1.5B's linear layers: 28 decoder layers and the LM head.
    qwen = {(1536, 1536): 56, (256, 1536): 56, (8960, 1536): 56, (1536, 8960): 28}
    qwen[(151936, 1536)] = 1
    rows = half_precision_rows(_meta_model(qwen))
    assert 0 < rows <= budget
    # The scarcest shape sets the rows: half as many uses of it, twice the rows (rounded up).
    fewer = {**qwen, (256, 1536): 28}
    assert half_precision_rows(_meta_model(fewer)) in (2 * rows - 1, 2 * rows)
    assert half_precision_rows(_meta_model(qwen), mismatches=20.0) in (2 * rows - 1, 2 * rows)
    tiny = load_model(str(tiny_pair[1]), dtype="bfloat16").model
    assert half_precision_rows(tiny) > budget


def test_a_half_precision_target_of_a_tiny_model_keeps_one_exact_width(bf16_engine):
    # Its layers are too small for a split set to show within the check: single widths only.
    assert len(bf16_engine.transport.verifier.exact.widths) == 1


def test_a_width_set_target_is_calibrated_to_a_set_of_several_widths(width_set_engine, tiny_pair):
    # The injected sets are real: the linear-layer measurement finds exactly them, the
    # whole-model check passes a set and fails a pair of widths across two, and the calibration
    # keeps several widths of one set (so the tests on width_set_engine pad to several widths).
    from width_sets import set_of, use_width_sets

    from specdec.device.exact_widths import (
        measure_exact_width_sets,
        use_row_wise_attention,
        whole_forward_exact,
    )

    widths = width_set_engine.transport.verifier.exact.widths
    assert len(widths) > 1
    assert len({set_of(w) for w in widths}) == 1
    loaded = load_model(str(tiny_pair[1]), dtype="bfloat16")
    use_width_sets(loaded.model)
    use_row_wise_attention(loaded.model)
    generator = torch.Generator().manual_seed(0)
    sets = measure_exact_width_sets(loaded.model, 12, generator=generator, elements=1_000)
    assert sets == [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    args = (loaded.model, loaded.vocab_size)
    assert whole_forward_exact(*args, (2, 3, 4), generator, max_trials=4)
    assert not whole_forward_exact(*args, (4, 5), generator, max_trials=1)


def test_a_checkable_half_precision_set_gets_the_longer_check(tiny_pair, monkeypatch):
    from specdec.device.calibration import measure

    checked = []

    def recording_check(model, vocab_size, widths, generator, **kwargs):
        checked.append((widths, kwargs.get("rows_per_width", 0)))
        return True

    monkeypatch.setattr(measure, "half_precision_rows", lambda model: 7)
    monkeypatch.setattr(measure, "whole_forward_exact", recording_check)
    loaded = load_model(str(tiny_pair[1]), dtype="bfloat16")
    generator = torch.Generator().manual_seed(0)
    costs = [1.0 + 0.01 * w for w in range(9)]
    exact = measure._exact_widths(loaded.model, loaded.vocab_size, costs, 9, generator, True)
    assert checked == [(exact.widths, 7)]
    assert len(exact.widths) > 1  # a set of several widths is cheapest on this cost curve
