"""specdec.config: one settings object, validated at start-up; reference: docs/configuration.md."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specdec import config as config_module
from specdec.config import (
    APPLICATION,
    SIDES,
    ModelConfig,
    ServiceConfig,
    SpecdecConfig,
    SpeculationConfig,
)
from specdec.config_reference import REFERENCE, field_docs, render_reference
from specdec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "deployments" / "config").glob("*.yaml"))
BASE = {"draft_model": "/models/draft", "target_model": "/models/target"}


def _app_args(path: Path) -> dict:
    raw = yaml.safe_load(path.read_text())
    return next(app["args"] for app in raw["applications"] if app["name"] == "specdec")


def test_the_configuration_reference_is_the_generated_one():
    reference = (ROOT / REFERENCE).read_text()
    assert render_reference(reference) == reference, (
        f"{REFERENCE} differs from specdec/config.py: run "
        "`python -m specdec.config_reference --write`"
    )


def test_every_setting_has_a_docstring_with_its_unit():
    for section in (ModelConfig, SpeculationConfig, ServiceConfig):
        for name, doc in field_docs(section).items():
            if name.endswith("_s"):
                assert "seconds" in doc.lower(), name
            if name.endswith("_bytes"):
                assert "bytes" in doc, name
            if name in ("max_speculative_tokens", "draft_top_n"):
                assert "tokens" in doc, name


def test_settings_have_one_name_each_across_the_concerns():
    names = [
        field.name
        for section in (ModelConfig, SpeculationConfig, ServiceConfig)
        for field in dataclasses.fields(section)
    ]
    assert len(names) == len(set(names))
    assert list(SpecdecConfig().to_args()) == names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_the_shipped_args_round_trip(path):
    args = _app_args(path)
    config = SpecdecConfig.from_args(args)
    parsed = config.to_args()
    assert {key: parsed[key] for key in args} == args
    assert SpecdecConfig.from_args(parsed) == config


def test_the_shipped_configs_use_every_key_the_service_had():
    used = set().union(*(_app_args(path) for path in SHIPPED))
    assert used <= set(SpecdecConfig().to_args())
    assert {"draft_model", "target_model", "dtype", "max_speculative_tokens"} <= used


def test_defaults_and_number_types():
    config = SpecdecConfig.from_args({**BASE, "call_timeout_s": 25})
    assert config.service.call_timeout_s == 25.0
    assert isinstance(config.service.call_timeout_s, float)
    assert config.models.dtype == ModelConfig().dtype
    assert config.speculation == SpeculationConfig()


BAD = [
    ("max_speculative_tokens", 0),
    ("max_speculative_tokens", -3),
    ("max_speculative_tokens", "8"),
    ("max_speculative_tokens", True),  # a bool is not an integer here
    ("max_speculative_tokens", 4.0),
    ("draft_top_n", -1),
    ("draft_top_n", None),
    ("dynamic_draft_length", 1),
    ("dynamic_draft_length", "yes"),
    ("concurrent_prefill", "false"),
    ("call_timeout_s", 0),
    ("call_timeout_s", -1.5),
    ("call_timeout_s", math.nan),
    ("call_timeout_s", math.inf),
    ("call_timeout_s", False),
    ("unavailable_after_s", "30"),
    ("dtype", "fp8"),
    ("dtype", None),
    ("draft_dtype", "int4"),
    ("dtype", "float32+blas"),
    ("dtype", "float16+dnnl"),  # not one of the old combined values either
    ("gemm", "blas"),
    ("gemm", "+dnnl"),
    ("draft_gemm", 3),
    ("device", "gpu"),
    ("device", "cuda:x"),
    ("cache_capacity_bytes", 0),
    ("cache_capacity_bytes", 1.5),
    ("exact_widths", "auto"),
    ("draft_pool", ""),
    ("target_pool", 3),
    ("draft_model", ""),
    ("target_model", 7),
]


@pytest.mark.parametrize("key, value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_a_bad_value_is_refused_naming_the_setting(key, value):
    with pytest.raises(ConfigError) as err:
        SpecdecConfig.from_args({**BASE, key: value})
    assert err.value.field == key
    assert str(err.value).startswith(f"{key}: ")
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("dtype", ["int8", "float32+dnnl", "float32+bf16w"])
@pytest.mark.parametrize("dtype_key", ["dtype", "draft_dtype"])
def test_cpu_only_dtypes_off_the_cpu_are_refused(dtype_key, dtype):
    with pytest.raises(ConfigError) as err:
        SpecdecConfig.from_args({**BASE, "device": "cuda:0", dtype_key: dtype})
    assert err.value.field == dtype_key and f"{dtype} runs on the CPU only" in str(err.value)
    SpecdecConfig.from_args({**BASE, "device": "cpu", dtype_key: dtype})


def test_unknown_keys_are_refused_naming_them():
    with pytest.raises(ConfigError) as err:
        SpecdecConfig.from_args({**BASE, "k_max": 4, "top_n": 2})
    assert err.value.field == "k_max"
    assert str(err.value).startswith("k_max: unknown setting")
    assert "top_n" in str(err.value) and "max_speculative_tokens" in str(err.value)


@pytest.mark.parametrize("key", ["draft_model", "target_model"])
def test_the_models_are_required_in_the_service_args(key):
    args = dict(BASE)
    del args[key]
    with pytest.raises(ConfigError) as err:
        SpecdecConfig.from_args(args)
    assert err.value.field == key


def test_args_that_are_not_a_mapping_are_refused():
    with pytest.raises(ConfigError) as err:
        SpecdecConfig.from_args(["draft_model"])
    assert err.value.field == "args"


def test_model_paths_expand_home_and_environment(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("SPECDEC_MODELS", "/srv/models")
    config = SpecdecConfig.from_args(
        {"draft_model": "~/draft", "target_model": "$SPECDEC_MODELS/target"}
    )
    assert config.models.draft_model == "/home/someone/draft"
    assert config.models.target_model == "/srv/models/target"
    bundled = SpecdecConfig.from_args({"draft_model": "bundled:draft", "target_model": "t"})
    assert bundled.models.draft_model == "bundled:draft"


def test_config_errors_survive_pickling():
    # Serve ships a failed build_app's exception between processes.
    err = pickle.loads(pickle.dumps(ConfigError("draft_top_n", "must be at least 0, got -1")))
    assert err.field == "draft_top_n" and str(err) == "draft_top_n: must be at least 0, got -1"


def test_of_builds_from_a_concern_or_flat_settings():
    speculation = SpeculationConfig(max_speculative_tokens=3)
    assert SpecdecConfig.of(speculation) == SpecdecConfig(speculation=speculation)
    assert SpecdecConfig.of(None, max_speculative_tokens=3, device="cuda").speculation == (
        speculation
    )
    whole = SpecdecConfig.of(speculation, draft_top_n=5, cache_capacity_bytes=1024)
    assert whole.speculation == SpeculationConfig(max_speculative_tokens=3, draft_top_n=5)
    assert whole.models.cache_capacity_bytes == 1024
    with pytest.raises(ConfigError) as err:
        SpecdecConfig.of({"max_speculative_tokens": 3})
    assert err.value.field == "config"
    with pytest.raises(ConfigError) as err:
        SpecdecConfig(models=SpeculationConfig())
    assert err.value.field == "models"


def test_the_config_is_frozen():
    config = SpecdecConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.speculation.max_speculative_tokens = 3


def test_each_side_loads_its_model_in_its_dtype():
    models = ModelConfig(draft_model="d", target_model="t", dtype="bfloat16", draft_dtype="int8")
    assert [models.for_side(side) for side in SIDES] == [("d", "int8"), ("t", "bfloat16")]
    same = ModelConfig(draft_model="d", target_model="t")
    assert same.for_side("draft") == ("d", same.dtype) and same.for_side("target")[1] == same.dtype


def test_the_dtype_names_are_the_ones_the_loader_accepts():
    from specdec.config import AUTO
    from specdec.device.calibration.candidates import Candidate
    from specdec.device.gemm import BF16_WEIGHTS, GEMMS, ONEDNN, WEIGHT_MAJOR
    from specdec.models.loading import DTYPES, INT8

    assert set(config_module.MODEL_DTYPES) == set(DTYPES) | {INT8, AUTO}
    assert set(config_module.MODEL_GEMMS) == set(GEMMS) | {AUTO}
    assert set(config_module.DTYPE_GEMMS) == set(DTYPES) | {INT8}
    # every (dtype, GEMM) pair a setting may name is one the old combined dtype named
    gemms = {"float32+" + g for g in (WEIGHT_MAJOR, ONEDNN, BF16_WEIGHTS)} | {"bfloat16+" + ONEDNN}
    pairs = {str(Candidate(d, g)) for d, runs in config_module.DTYPE_GEMMS.items() for g in runs}
    assert pairs == set(DTYPES) | {INT8} | gemms


# Every value the combined dtype took: the (dtype, gemm) settings it now reads as, and the
# (dtype, gemm) each side runs: exactly the old string's.
OLD_DTYPES = {
    "auto": ("auto", "auto"),
    "float32": ("float32", "plain"),
    "float32+wm": ("float32", "wm"),
    "float32+dnnl": ("float32", "dnnl"),
    "float32+bf16w": ("float32", "bf16w"),
    "bfloat16": ("bfloat16", "plain"),
    "bfloat16+dnnl": ("bfloat16", "dnnl"),
    "float16": ("float16", "plain"),
    "int8": ("int8", "plain"),
}


@pytest.mark.parametrize("old, new", OLD_DTYPES.items(), ids=list(OLD_DTYPES))
def test_an_old_combined_dtype_reads_as_the_same_dtype_and_gemm(old, new, caplog):
    with caplog.at_level(logging.WARNING, logger="specdec.config"):
        models = SpecdecConfig.from_args({**BASE, "dtype": old}).models
    for side in SIDES:  # the draft follows the target's dtype, its GEMM included
        assert (models.for_side(side)[1], models.gemm_for(side)) == new
    if "+" in old:
        dtype, gemm = new
        assert (models.dtype, models.gemm) == new
        assert f"dtype: {old} is deprecated: write dtype: {dtype} and gemm: {gemm}" in caplog.text
    else:
        assert models.gemm is None and "deprecated" not in caplog.text
    own = SpecdecConfig.from_args({**BASE, "dtype": "bfloat16", "draft_dtype": old}).models
    assert (own.for_side("draft")[1], own.gemm_for("draft")) == new
    assert (own.for_side("target")[1], own.gemm_for("target")) == ("bfloat16", "plain")
    # the old string with a draft dtype of its own: the draft runs that dtype's plain GEMM
    # (or auto), as it did
    split = SpecdecConfig.from_args({**BASE, "dtype": old, "draft_dtype": "int8"}).models
    assert (split.for_side("draft")[1], split.gemm_for("draft")) == ("int8", "plain")


@pytest.mark.parametrize("value", [False, True, None])
def test_the_old_name_of_exact_widths_is_read_with_a_warning(value, caplog):
    with caplog.at_level(logging.WARNING, logger="specdec.config"):
        models = SpecdecConfig.from_args({**BASE, "fixed_shape_verify": value}).models
    assert models.exact_widths is value
    assert "fixed_shape_verify is deprecated: it is now called exact_widths" in caplog.text
    with pytest.raises(ConfigError, match="fixed_shape_verify: is the old name of exact_widths"):
        SpecdecConfig.from_args({**BASE, "fixed_shape_verify": value, "exact_widths": value})
    with pytest.raises(ConfigError, match="exact_widths"):
        SpecdecConfig.of(fixed_shape_verify="yes")


def test_dtype_and_gemm_are_two_settings():
    models = SpecdecConfig.from_args({**BASE, "dtype": "float32", "gemm": "dnnl"}).models
    assert [(models.for_side(s)[1], models.gemm_for(s)) for s in SIDES] == [
        ("float32", "dnnl"),
        ("float32", "dnnl"),
    ]
    models = SpecdecConfig.from_args(
        {**BASE, "dtype": "float32", "gemm": "dnnl", "draft_gemm": "plain"}
    ).models
    assert models.gemm_for("draft") == "plain" and models.gemm_for("target") == "dnnl"
    models = SpecdecConfig.from_args({**BASE, "dtype": "bfloat16", "gemm": "auto"}).models
    assert models.gemm_for("target") == models.gemm_for("draft") == "auto"
    models = SpecdecConfig.from_args({**BASE, "dtype": "auto", "draft_dtype": "int8"}).models
    assert (models.gemm_for("target"), models.gemm_for("draft")) == ("auto", "plain")


INVALID_PAIRS = [
    ({"dtype": "bfloat16", "gemm": "bf16w"}, "gemm"),  # bf16w runs a float32 model
    ({"dtype": "bfloat16", "gemm": "wm"}, "gemm"),
    ({"dtype": "int8", "gemm": "dnnl"}, "gemm"),
    ({"dtype": "float16", "gemm": "dnnl"}, "gemm"),
    ({"dtype": "auto", "gemm": "dnnl"}, "gemm"),  # a fixed GEMM runs fixed dtypes
    ({"draft_dtype": "int8", "draft_gemm": "wm"}, "draft_gemm"),
    ({"dtype": "bfloat16", "draft_gemm": "bf16w"}, "draft_gemm"),
    ({"dtype": "float32+dnnl", "gemm": "wm"}, "gemm"),  # the old string names another GEMM
    ({"device": "cuda", "gemm": "dnnl"}, "gemm"),
    ({"device": "cuda", "draft_gemm": "bf16w"}, "draft_gemm"),
]


@pytest.mark.parametrize("settings, field", INVALID_PAIRS, ids=[str(s) for s, _ in INVALID_PAIRS])
def test_an_invalid_dtype_and_gemm_is_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError) as err:
        SpecdecConfig.from_args({**BASE, **settings})
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_the_candidates_of_the_settings():
    from specdec.device.calibration.candidates import Candidate, candidates, configured

    for role in SIDES:
        every = candidates(role, "cpu")
        assert configured("auto", "auto", role, "cpu") == every
        assert configured("float32", "plain", role, "cpu") == [Candidate("float32")]
        assert configured("float32", "dnnl", role, "cpu") == [Candidate("float32", "dnnl")]
        assert configured("auto", "plain", role, "cpu") == [c for c in every if c.gemm == "plain"]
        float32 = configured("float32", "auto", role, "cpu")
        assert float32 == [c for c in every if c.dtype == "float32"]
        assert Candidate("float32") in float32
        assert configured("float16", "auto", role, "cpu") == [Candidate("float16")]
    assert configured("bfloat16", "auto", "target", "cuda") == [Candidate("bfloat16")]


def test_the_config_module_imports_neither_ray_nor_torch_nor_the_engine():
    code = (
        "import sys, specdec.config; "
        "bad = {'ray', 'torch', 'specdec.engine'} & set(sys.modules); "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_engine_builds_its_config_once_from_keyword_arguments(engine, tiny_pair):
    from specdec import SpeculativeEngine

    built = SpeculativeEngine(
        engine.draft,
        engine.target,
        max_speculative_tokens=3,
        draft_top_n=5,
        dynamic_draft_length=False,
        cache_capacity_bytes=10**6,
        exact_widths=False,
    )
    assert built.config.speculation == SpeculationConfig(
        max_speculative_tokens=3, draft_top_n=5, dynamic_draft_length=False
    )
    assert built.limits.max_speculative_tokens == 3
    assert built.transport.verifier.sessions.capacity_bytes == 10**6
    assert built.transport.verifier.exact is None  # exact_widths=False: plain forwards
    with pytest.raises(ConfigError) as err:
        SpeculativeEngine(engine.draft, engine.target, k_max=3)
    assert err.value.field == "k_max"
    # The verifier measures its widths at construction, 1 .. k_max + 1 and a few beyond.
    fixed = SpeculativeEngine.from_pretrained(
        *tiny_pair, SpeculationConfig(max_speculative_tokens=3), exact_widths=True
    )
    exact = fixed.transport.verifier.exact
    assert exact is not None and len(exact.forward_s) == 3 + 1 + 4
    assert fixed.config.models.draft_model == str(tiny_pair[0])


def test_build_app_refuses_bad_args_naming_the_setting():
    pytest.importorskip("ray")
    from specdec.deployments.app import build_app

    with pytest.raises(ConfigError) as err:
        build_app({**BASE, "max_speculative_tokens": 0})
    assert err.value.field == "max_speculative_tokens"


def _serve_config(tmp_path: Path, **args) -> Path:
    raw = yaml.safe_load((ROOT / "deployments" / "config" / "local.yaml").read_text())
    raw["applications"][0]["args"] = args
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_resolve_bundled_converts_in_the_dtype_the_replicas_load(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    from specdec.deployments import deploy
    from specdec.models import bundled

    calls = []
    monkeypatch.setattr(bundled, "resolve", lambda spec, dtype: calls.append((spec, dtype)) or spec)
    bundled_pair = {"draft_model": "bundled:draft", "target_model": "bundled:target"}
    deploy.resolve_models(_serve_config(tmp_path, **bundled_pair))
    default = ModelConfig().dtype  # one default for the conversion and the replicas
    assert calls == [("bundled:draft", default), ("bundled:target", default)]
    calls.clear()
    deploy.resolve_models(
        _serve_config(tmp_path, **bundled_pair, dtype="bfloat16", draft_dtype="int8")
    )
    assert calls == [("bundled:draft", "int8"), ("bundled:target", "bfloat16")]


@pytest.mark.parametrize("config_dtype", ["auto", None])
def test_a_dtype_override_is_the_targets_and_the_draft_keeps_the_configs(tmp_path, config_dtype):
    pytest.importorskip("ray")
    from specdec.deployments import deploy

    settings = {"dtype": config_dtype} if config_dtype else {}
    path = _serve_config(tmp_path, **BASE, **settings)
    models = deploy.app_config(deploy.load_config(path, {"dtype": "bfloat16"})).models
    assert models.for_side("target")[1] == "bfloat16"
    assert models.for_side("draft")[1] == (config_dtype or ModelConfig().dtype)
    both = deploy.load_config(path, {"dtype": "bfloat16", "draft_dtype": "int8"})
    assert deploy.app_config(both).models.for_side("draft")[1] == "int8"
    own = _serve_config(tmp_path, **BASE, **settings, draft_dtype="float32")
    models = deploy.app_config(deploy.load_config(own, {"dtype": "bfloat16"})).models
    assert models.for_side("draft")[1] == "float32"


def test_serve_refuses_a_bad_config_before_deploying(tmp_path, capsys):
    pytest.importorskip("ray")
    from specdec.cli import main

    path = _serve_config(tmp_path, **BASE, draft_top_n=-1)
    assert main(["serve", "--config", str(path), "--address", "127.0.0.1:1"]) == 1
    assert capsys.readouterr().err.startswith("specdec: draft_top_n: must be at least 0")


def test_serve_parses_the_config_once_and_deploys_that_object(tmp_path, monkeypatch, capsys):
    """`specdec serve` on this machine: the config is parsed once, the bundled pair converted
    from it, and deploy gets the parsed config with the converted directories in its args."""
    pytest.importorskip("ray")
    from specdec.cli import main
    from specdec.cluster import local
    from specdec.deployments import deploy
    from specdec.models import bundled

    parses, deployed = [], []
    from_args = SpecdecConfig.from_args.__func__
    monkeypatch.setattr(
        SpecdecConfig,
        "from_args",
        classmethod(lambda cls, a: parses.append(a) or from_args(cls, a)),
    )
    monkeypatch.setattr(bundled, "resolve", lambda spec, dtype: f"/converted/{spec}-{dtype}")
    monkeypatch.setattr(local, "address", lambda: "127.0.0.1:1")
    monkeypatch.setattr(deploy, "deploy", lambda config, **kw: deployed.append((config, kw)))
    monkeypatch.setattr("specdec.tools.serve.check_pair", lambda config: None)  # no such models
    path = _serve_config(tmp_path, draft_model="bundled:draft", target_model="/models/target")
    assert main(["serve", "--config", str(path), "--draft-dtype", "int8"]) == 0
    assert len(parses) == 1
    ((config, kwargs),) = deployed
    assert kwargs == {"address": "127.0.0.1:1"}
    assert config.app.models.draft_model == "/converted/bundled:draft-int8"
    (app,) = [a for a in config.schema.applications if a.name == APPLICATION]
    assert app.args["draft_model"] == "/converted/bundled:draft-int8"
    assert app.args["draft_dtype"] == "int8"
    out = capsys.readouterr().out
    assert f"gRPC  127.0.0.1:{config.grpc_port}" in out
    assert "HTTP  http://127.0.0.1:8000/v1 " in out  # the shipped route prefix is /


def _deployed_with(tmp_path, monkeypatch, *flags: str):
    """The ServeConfig `specdec serve --config X --address A FLAGS` would deploy (deploy
    replaced), and what it printed."""
    from specdec.cli import main
    from specdec.deployments import deploy

    deployed = []
    monkeypatch.setattr(deploy, "deploy", lambda config, **kw: deployed.append(config))
    path = _serve_config(tmp_path, **BASE)
    status = main(["serve", "--config", str(path), "--address", "127.0.0.1:1", *flags])
    return status, (deployed[0] if deployed else None)


def test_serve_set_overrides_a_setting_and_any_serve_config_path(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    from specdec.deployments.deploy import deployment_options

    status, config = _deployed_with(
        tmp_path,
        monkeypatch,
        *("--set", "call_timeout_s=7", "--set", "default_max_tokens=null"),
        *("--set", "deployments.TargetModel.autoscaling_config.max_replicas=4"),
        *("--set", "deployments.DraftModel.max_ongoing_requests=9"),
        *("--set", "http_options.port=8123", "--set", "proxy_location=EveryNode"),
    )
    assert status == 0
    assert config.app.service.call_timeout_s == 7.0
    assert config.app.service.default_max_tokens is None
    (app,) = config.schema.applications
    options = {d.name: deployment_options(d) for d in app.deployments}
    assert options["TargetModel"]["autoscaling_config"]["max_replicas"] == 4
    # the rest of the entry is the config's
    assert options["TargetModel"]["autoscaling_config"]["target_ongoing_requests"] == 8
    assert options["DraftModel"]["max_ongoing_requests"] == 9
    assert config.schema.proxy_location == "EveryNode"
    assert "http://127.0.0.1:8123/v1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("no_such_setting=1", "no_such_setting"),
        ("nothing.port=1", "nothing.port"),
        ("deployments.TargetModel=1", "deployments.TargetModel"),
        ("call_timeout_s=[1", "call_timeout_s"),
    ],
)
def test_a_bad_set_is_refused_naming_its_key(tmp_path, monkeypatch, capsys, flag, named):
    pytest.importorskip("ray")
    with pytest.raises(SystemExit) if "[" in flag else contextlib.nullcontext():
        status, config = _deployed_with(tmp_path, monkeypatch, "--set", flag)
        assert (status, config) == (1, None)
    err = capsys.readouterr().err
    assert named in err, err


def test_a_deployment_entry_the_app_cannot_apply_is_refused_before_deploying(tmp_path):
    """Options for no deployment, or a field Deployment.options() has not, are refused when the
    application is built here, before Serve starts; the app's runtime_env sits under each
    deployment's own, as Serve merges them."""
    pytest.importorskip("ray")
    from ray.serve.schema import DeploymentSchema

    from specdec.deployments.deploy import ServeConfig, deployment_options, run_target

    path = _serve_config(tmp_path, **BASE)
    config = ServeConfig.load(path, {"deployments.Nope.num_replicas": 2})
    with pytest.raises(ConfigError, match="no deployment named 'Nope'"):
        run_target(config.schema.applications[0])
    entry = DeploymentSchema(name="TargetModel", rolling_update_percentage=0.5)
    with pytest.raises(ConfigError) as err:
        deployment_options(entry)
    assert err.value.field == "deployments.TargetModel.rolling_update_percentage"
    own = {"runtime_env": {"env_vars": {"A": "own"}, "pip": ["x"]}, "num_cpus": 0}
    merged = deployment_options(
        DeploymentSchema(name="TargetModel", ray_actor_options=own),
        {"env_vars": {"A": "app", "B": "app"}, "pip": ["y"], "working_dir": "."},
    )["ray_actor_options"]
    assert merged["runtime_env"] == {
        "env_vars": {"A": "own", "B": "app"},
        "pip": ["x"],
        "working_dir": ".",
    }
