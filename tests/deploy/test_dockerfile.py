"""deploy/Dockerfile and .dockerignore, read statically (no docker on these machines): the
image is the repository on python:3.11-slim with a CPU torch by default, runs as a
non-root user with `slotune` as its entrypoint, and is what the manifests and the docs name."""

from __future__ import annotations

import json
import re

import yaml

from tests.deploy.manifests import DEPLOY, ROOT, k8s_objects

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
    assert not pending, "a continuation runs off the end"
    return out


def stages() -> list[list[tuple[str, str]]]:
    """The build stages, each from its FROM; ARGs before the first FROM are in stage 0."""
    out: list[list[tuple[str, str]]] = [[]]
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


def args(stage: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for w, a in stage if w == "ARG" and "=" in a)


def test_final_stage_is_python_slim_non_root_with_slotune_as_entrypoint() -> None:
    global_args, *built = stages()
    final = built[-1]
    image = final[0][1].split(" AS ")[0]
    assert image.replace("${PYTHON_IMAGE}", args(global_args)["PYTHON_IMAGE"]) == (
        "python:3.11-slim"
    )
    users = [a for w, a in final if w == "USER"]
    assert users, "the image runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: runAsNonRoot can check it
    assert [w for w, _ in final].index("USER") > max(
        i for i, (w, _) in enumerate(final) if w == "RUN"
    )  # nothing runs as root after it
    (entry,) = [a for w, a in final if w == "ENTRYPOINT"]
    assert json.loads(entry) == ["slotune"]
    # the manifests run it as that user
    for _, d in k8s_objects():
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        if "securityContext" in pod:
            assert pod["securityContext"]["runAsUser"] == int(uid)


def test_torch_is_cpu_by_default_and_pinned_as_the_makefile_pins_it() -> None:
    final = stages()[-1]
    a = args(final)
    assert a["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_SPEC ?= {a['TORCH_SPEC']}" in makefile
    runs = [r for w, r in final if w == "RUN"]
    assert any('--index-url "${TORCH_INDEX}" "${TORCH_SPEC}"' in r for r in runs)


def test_ray_is_the_version_the_rayservices_run() -> None:
    spec = args(stages()[-1])["RAY_SPEC"]
    version = re.fullmatch(r"ray\[serve\]==([\d.]+)", spec).group(1)
    for path in sorted((DEPLOY / "kuberay").glob("*.yaml")):
        rs = yaml.safe_load(path.read_text())
        assert rs["spec"]["rayClusterConfig"]["rayVersion"] == version, path.name


def test_the_repository_is_built_and_installed() -> None:
    build, final = stages()[1], stages()[-1]
    assert ("COPY", ". .") in build
    assert any(w == "RUN" and "pip wheel" in a and a.endswith(" .") for w, a in build)
    assert any(w == "COPY" and a.startswith("--from=build /wheels") for w, a in final)
    assert any(w == "RUN" and "/wheels/*.whl" in a for w, a in final)
    # KubeRay's exec probes on Ray pods call wget through bash
    assert any(w == "RUN" and "install" in a and " wget" in a for w, a in final)


def _pattern(p: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus ``**``) as a regex."""
    out, i = "", 0
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(p[i], re.escape(p[i]))
            i += 1
    return re.compile(out)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a pattern that matches a directory takes everything under it, and
    the last matching pattern wins (``!`` re-includes)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    hit = False
    for p in patterns:
        neg = p.startswith("!")
        rx = _pattern(p.removeprefix("!").rstrip("/"))
        if any(rx.fullmatch(x) for x in prefixes):
            hit = not neg
    return hit


def test_dockerignore_keeps_the_build_inputs_and_drops_local_state() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "serving/__pycache__/x.cpython-311.pyc",
        ".pytest_cache/v",
        ".ruff_cache/x",
        "build/lib/x.py",
        "slotune.egg-info/PKG-INFO",
        "slotune-out/20260101/curve.json",
        "serving/scheduler/seq.cpython-311-x86_64-linux-gnu.so",
        "serving/_native.json",
    ):
        assert _ignored(path, patterns), path
    for path in (
        "pyproject.toml",
        "setup.py",
        "README.md",
        "serving/native.py",
        "serving/app/server.py",
        "controller/cli/main.py",
        "metrics/names.py",
        "search/space.py",
    ):
        assert (ROOT / path).exists() and not _ignored(path, patterns), path


def test_manifests_use_the_images_the_docs_build() -> None:
    docs = (ROOT / "docs" / "deploy.md").read_text()
    build = r"docker build -f deploy/Dockerfile(?: [^\n]*?)? -t (\S+)[^\n]* \.$"
    builds = re.findall(build, docs, re.M)
    assert set(builds) == {"slotune:latest", "slotune:cuda"}
    used = set()
    for _, d in k8s_objects():
        text = yaml.safe_dump(d)
        used |= set(re.findall(r"image: (\S+)", text))
    assert used - set(builds) == {"registry.k8s.io/kubectl:v1.31.0"}
    assert set(builds) <= used
