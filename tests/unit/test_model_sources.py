"""Models from elsewhere (specdec.models.sources): Hub ids at a revision, through a local
stand-in for the Hub (tests/hub_server.py) in fresh processes, so that HF_ENDPOINT, HF_TOKEN,
HF_HOME and HF_HUB_OFFLINE are read as a user's shell sets them; folder URIs; and what
`specdec serve` does with them before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer

from specdec.errors import ModelLoadError
from specdec.models import sources
from specdec.models.tiny import save_pair


@pytest.fixture(scope="module")
def hub(tiny_pair):
    """A Hub with acme/tiny-target (main: the tiny target, v1: the tiny draft's folder) and
    acme/gated (the target, behind the token "s3cret")."""
    draft, target = tiny_pair
    with HubServer() as server:
        server.refs = server.add("acme/tiny-target", {"main": target, "v1": draft})
        server.add("acme/gated", {"main": target}, token="s3cret")
        yield server


def _run(code: str, hub: HubServer, home: Path, **env: str) -> tuple[int, str]:
    """Runs ``code`` in a fresh Python with the Hub at ``hub`` and the Hugging Face cache in
    ``home``; (exit status, stdout + stderr)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    clean |= {"HF_HOME": str(home), "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout + done.stderr


def _fetch(spec: str, revision: str | None, hub, home, **env) -> tuple[int, str]:
    code = f"from specdec.models.sources import fetch; print('PATH', fetch({spec!r}, {revision!r}))"
    status, out = _run(code, hub, home, **env)
    paths = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("PATH ")]
    return status, paths[0] if paths else out


def test_a_hub_id_is_downloaded_at_its_revision_and_loads(hub, tiny_pair, tmp_path):
    """main, a branch and a pinned commit each give that commit's files; the loaded model is
    named by its Hub id (the id the HTTP API lists)."""
    draft, target = tiny_pair
    for revision, folder in ((None, target), ("v1", draft), (hub.refs["v1"], draft)):
        status, path = _fetch("acme/tiny-target", revision, hub, tmp_path)
        assert status == 0, path
        commit = hub.refs["main" if revision is None else "v1"]
        assert Path(path).name == commit
        assert (Path(path) / "config.json").read_text() == (folder / "config.json").read_text()
    code = (
        "from specdec.models.loading import load_model; m = load_model('acme/tiny-target', "
        "revision='v1'); print('NAME', m.name, m.model.config.hidden_size)"
    )
    status, out = _run(code, hub, tmp_path)
    assert status == 0, out
    hidden = json.loads((draft / "config.json").read_text())["hidden_size"]
    assert f"NAME acme/tiny-target {hidden}" in out


def test_a_gated_repository_needs_hf_token(hub, tmp_path):
    status, out = _fetch("acme/gated", None, hub, tmp_path)
    assert status == 1 and "acme/gated@main: gated; set HF_TOKEN" in out
    status, path = _fetch("acme/gated", None, hub, tmp_path, HF_TOKEN="s3cret")
    assert status == 0 and (Path(path) / "config.json").is_file(), path


@pytest.mark.parametrize(
    ("spec", "revision", "message"),
    [
        ("acme/nothing", None, "acme/nothing@main: no such repository on http://127.0.0.1:"),
        ("acme/tiny-target", "v9", "acme/tiny-target@v9: no such revision"),
    ],
)
def test_a_missing_repository_or_revision_is_named(hub, tmp_path, spec, revision, message):
    status, out = _fetch(spec, revision, hub, tmp_path)
    assert status == 1 and message in out, out


def test_offline_reads_the_cache_and_asks_the_hub_nothing(hub, tmp_path):
    assert _fetch("acme/tiny-target", None, hub, tmp_path)[0] == 0
    asked = len(hub.requests)
    status, path = _fetch("acme/tiny-target", None, hub, tmp_path, HF_HUB_OFFLINE="1")
    assert status == 0 and Path(path).name == hub.refs["main"]
    status, out = _fetch("acme/gated", None, hub, tmp_path, HF_HUB_OFFLINE="1")
    assert status == 1 and "not in the Hugging Face cache" in out
    assert len(hub.requests) == asked


def test_a_folder_uri_is_copied_once(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "models"))
    target = tiny_pair[1]
    local = Path(sources.fetch(target.as_uri()))
    assert local.parent == tmp_path / "models" and local.name.startswith("uri-")
    assert (local / "config.json").read_bytes() == (target / "config.json").read_bytes()
    (local / "config.json").write_text("{}")  # a second fetch finds the whole copy, copies nothing
    assert sources.fetch(target.as_uri()) == str(local)
    assert (local / "config.json").read_text() == "{}"
    with pytest.raises(ModelLoadError, match="no such folder"):
        sources.fetch((tmp_path / "absent").as_uri())
    with pytest.raises(ModelLoadError, match="nosuchfs://x"):
        sources.fetch("nosuchfs://x")


def test_what_each_spec_is():
    assert sources.is_remote("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert sources.is_remote("s3://bucket/models/target")
    for local in ("bundled:target", "/models/target", "./target", "~/m/x.gguf", "target"):
        assert not sources.is_remote(local), local
        assert sources.fetch(local) == local
    with pytest.raises(ModelLoadError, match="a revision applies only to a Hugging Face Hub id"):
        sources.fetch("/models/target", "main")


def _serve(monkeypatch, *flags: str):
    """`specdec serve --local FLAGS` with the cluster and deploy replaced: (status, the config
    deploy got or None, whether a cluster was started)."""
    from types import SimpleNamespace

    from specdec.cli import main
    from specdec.cluster import local
    from specdec.deployments import deploy

    deployed, started = [], []

    def no_cluster():
        raise RuntimeError("no local cluster")

    monkeypatch.setattr(local, "address", no_cluster)
    monkeypatch.setattr(local, "up", lambda: started.append(1) or SimpleNamespace(address="a"))
    monkeypatch.setattr(deploy, "deploy", lambda config, **kw: deployed.append(config))
    status = main(["serve", "--local", *flags])
    return status, (deployed[0] if deployed else None), bool(started)


def test_serve_fetches_a_hub_pair_first_and_names_it_by_its_id(monkeypatch, tiny_pair):
    pytest.importorskip("ray")
    draft, target = tiny_pair
    fetched = []

    def fake_fetch(spec, revision=None):
        fetched.append((spec, revision))
        return str({"acme/draft": draft, "acme/target": target}.get(spec, spec))

    monkeypatch.setattr(sources, "fetch", fake_fetch)
    flags = ["--draft-model", "acme/draft", "--target-model", "acme/target"]
    status, config, started = _serve(
        monkeypatch, *flags, "--target-revision", "v1", "--dtype", "float32"
    )
    assert status == 0 and started
    assert sorted(fetched) == [("acme/draft", None), ("acme/target", "v1")]
    models, service = config.app.models, config.app.service
    assert (models.draft_model, models.target_model) == (str(draft), str(target))
    assert models.target_revision is None  # the folder is that revision's
    assert service.served_model_name == "acme/target"


def test_serve_refuses_a_draft_with_another_tokenizer_before_starting_anything(
    monkeypatch, tiny_pair, tmp_path, capsys
):
    pytest.importorskip("ray")
    other_draft, _ = save_pair(tmp_path, vocab_size=300)
    flags = ["--draft-model", str(other_draft), "--target-model", str(tiny_pair[1])]
    status, config, started = _serve(monkeypatch, *flags, "--dtype", "float32")
    assert (status, config, started) == (1, None, False)
    err = capsys.readouterr().err
    assert f"draft_model {other_draft} cannot draft for target_model {tiny_pair[1]}" in err
    assert "share a tokenizer" in err


def test_the_k8s_init_step_puts_a_hub_model_on_the_volume(hub, tiny_pair, tmp_path):
    """`python -m specdec.tools.k8s models` (the pods' init container) with a Hub id at a
    revision and HF_TOKEN: the download lands on the volume, linked where the Serve config
    expects the model."""
    volume = tmp_path / "models"
    flags = ["models", str(volume), "--roles", "target", "--target", "acme/gated"]
    done = subprocess.run(
        [sys.executable, "-m", "specdec.tools.k8s", *flags, "--target-revision", "main"],
        env={k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        | {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "s3cret", "HF_HOME": str(tmp_path / "h")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    link = (volume / "target").readlink()
    assert link.parts[0] == ".hub" and not link.is_absolute()
    config = (volume / "target" / "config.json").read_bytes()
    assert config == (tiny_pair[1] / "config.json").read_bytes()
