"""The Helm chart in deploy/helm/proserve, rendered and validated offline (issue 15).

Rendering uses Helm's own engine (Helm v4's Go SDK, which the ``helm-python-sdk`` package
ships as a shared library: no ``helm`` binary, no cluster), in a child process; every
rendered document is validated, strictly (unknown fields are errors), against the
Kubernetes 1.29 OpenAPI schemas that the ``kubernetes-validate`` package bundles. Then the checks that matter for ProServe:
probes on /health, the accelerator switch's resource keys, keys only through Secrets,
Prometheus annotations, headless Services, the dispatcher's worker list against the
StatefulSets' pod DNS names, and every container command parsed by the real argparse
parser of its entry point. deploy/README.md's guide is checked against the chart too.

Nothing here deploys: no cluster is available in CI.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="needs PyYAML")
if importlib.util.find_spec("helm_python") is None:
    pytest.skip("needs helm-python-sdk (Helm's engine, to render the chart offline): pip install helm-python-sdk",
                allow_module_level=True)
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (bundled "
                                                                        "Kubernetes schemas): pip install "
                                                                        "kubernetes-validate")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "proserve"
GUIDE = ROOT / "deploy" / "README.md"
K8S_VERSION = "1.29"
RELEASE, NAMESPACE = "ps", "llm"
FULLNAME = "ps-proserve"

# the accelerator switch: --device, and the extended resource the worker pods request
SWITCH = {
    "cpu": ("cpu", None),
    "cuda": ("cuda", "nvidia.com/gpu"),
    "ascend": ("npu", "huawei.com/Ascend910"),
}
ACCEL_RESOURCES = {"nvidia.com/gpu", "huawei.com/Ascend910"}
CASES = {
    "default": {},
    "cuda": {"accelerator": "cuda", "model": {"name": "/models/m", "pvc": "weights"},
             "prefill": {"replicas": 3, "gpuMemoryUtilization": "0.9", "tensorParallelSize": 2,
                         "vllmArgs": ["--max-num-seqs", "64", "-pp", "1"]},
             "decode": {"replicas": 2, "tensorParallelSize": 3}},
    "ascend": {"accelerator": "ascend", "model": {"name": "Qwen/Qwen2.5-7B-Instruct", "hfTokenSecret": "hf"},
               "latencyModel": {"configMap": "lm"}, "prefill": {"replicas": 2, "extraArgs": ["--gamma", "1.5"]},
               "decode": {"localPolicy": "vllm_fcfs"}, "bindPodIP": False},
}


# Helm's engine is a Go shared library: it runs in a child process, so that no Go runtime lives
# in the test process beside vLLM and the other suites (signals, threads, fork).
_HELM = r"""
import json, sys
try:
    import helm_python as helm
except (ImportError, OSError) as e:   # e.g. no wheel with the native library for this platform
    json.dump({"unavailable": f"{type(e).__name__}: {e}"}, sys.stdout)
    sys.exit(0)
req = json.load(sys.stdin)
try:
    if req["op"] == "lint":
        out = helm.lint(req["chart"], strict=True, kube_version=req["kube_version"])
    else:
        with helm.Chart.load(req["chart"]) as chart:
            if req["op"] == "render":
                out = chart.render(req["values"], name=req["name"], namespace=req["namespace"])
            else:
                out = chart.merge_values(req["values"])
    json.dump({"ok": out}, sys.stdout)
except helm.HelmError as e:
    json.dump({"error": type(e).__name__, "message": str(e)}, sys.stdout)
"""


class HelmError(Exception):
    """Helm refused the chart or the values (its error type and message)."""


@functools.cache
def _helm(request: str):
    p = subprocess.run([sys.executable, "-c", _HELM], input=request, capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, f"helm-python-sdk failed: {p.stderr[-2000:]}"
    answer = json.loads(p.stdout)
    if "unavailable" in answer:
        pytest.skip(f"helm-python-sdk does not load here: {answer['unavailable']}")
    if "error" in answer:
        raise HelmError(f"{answer['error']}: {answer['message']}")
    return json.dumps(answer["ok"])


def helm_call(op: str, values: dict | None = None, **kw):
    request = json.dumps({"op": op, "chart": str(CHART), "values": values or {}, **kw}, sort_keys=True)
    return json.loads(_helm(request))


def render(values: dict | None = None) -> dict[str, str]:
    return helm_call("render", values, name=RELEASE, namespace=NAMESPACE)


def documents(values: dict | None = None) -> list[dict]:
    docs = []
    for path, text in sorted(render(values).items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def merged_values(values: dict) -> dict:
    """The values an install would use: the chart's defaults merged with ``values``."""
    return helm_call("merge", values)


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs):
    """(component, pod spec, pod template metadata) of every workload."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            t = d["spec"]["template"]
            out.append((t["metadata"]["labels"]["app.kubernetes.io/component"], t["spec"], t["metadata"]))
    return out


def container(docs, component):
    [spec] = [s for c, s, _ in pod_specs(docs) if c == component]
    [c] = spec["containers"]
    return c, spec


def cluster_config(docs) -> dict:
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    return json.loads(cm["data"]["cluster.json"])


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    values = CASES[request.param]
    return request.param, values, documents(values), merged_values(values)


# -- rendering and schema validation ---------------------------------------------------------


def test_lint_strict():
    report = helm_call("lint", kube_version=f"v{K8S_VERSION}.0")
    assert not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report


def test_every_document_validates_strictly(case):
    name, _, docs, _ = case
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ConfigMap", "Deployment", "Service", "Service", "Service", "StatefulSet",
                            "StatefulSet", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy"]), kinds
    for d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {d['kind']} {d['metadata']['name']}: {e}")


def test_strict_validation_catches_a_misspelt_field():
    """The validator is strict (not a no-op): one misplaced key fails it."""
    docs = documents()
    sts = by_kind(docs, "StatefulSet")[f"{FULLNAME}-prefill"]
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/health"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values, message", [
    ({"accelerator": "tpu"}, "accelerator"),
    ({"prefill": {"replicas": 0}}, "replicas"),
    ({"secrets": {"apiKeys": ""}}, "apiKeys"),
    ({"model": {"pvc": "a", "hostPath": "/b"}}, "not both"),
    # tensor parallelism is one value per pool: the devices per pod and the worker's flag
    ({"acceleratorsPerWorker": 2}, "acceleratorsPerWorker is gone: set prefill.tensorParallelSize"),
    ({"prefill": {"vllmArgs": ["--tensor-parallel-size", "2"]}},
     "prefill.vllmArgs: --tensor-parallel-size: set prefill.tensorParallelSize instead"),
    ({"decode": {"vllmArgs": ["-tp=2"]}}, "decode.vllmArgs: -tp=2: set decode.tensorParallelSize instead"),
    ({"decode": {"extraArgs": ["--tensor-parallel-size", "2"]}}, "decode.extraArgs: --tensor-parallel-size"),
    ({"prefill": {"vllmArgs": ["--pipeline-parallel-size", "2"]}},
     "--pipeline-parallel-size 2: pipeline parallelism is not supported"),
    ({"decode": {"vllmArgs": ["-pp=4"]}}, "-pp=4: pipeline parallelism is not supported"),
    ({"decode": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"decode": {"tensorParallelSize": 2, "kvPort": 65535}}, "rank ports go past 65535"),
    # an Ascend host path says what it is, so that a node without it fails the pod by name
    ({"ascend": {"hostPaths": ["/usr/local/dcmi"]}}, "hostPaths"),
    ({"ascend": {"hostPaths": [{"path": "/usr/local/dcmi"}]}}, "hostPaths"),
    ({"ascend": {"hostPaths": [{"path": "/x", "type": "DirectoryOrCreate"}]}}, "hostPaths"),
])
def test_bad_values_are_refused(values, message):
    with pytest.raises(HelmError, match=message):
        render(values)


# -- what the deployment needs --------------------------------------------------------------


def test_probes_on_health(case):
    _, _, docs, _ = case
    for component in ("prefill", "decode"):
        c, _ = container(docs, component)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (component, probe)
    c, _ = container(docs, "dispatcher")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # the dispatcher's /health is 503 while a pool is down: liveness must not restart it for that
    assert c["livenessProbe"] == {**c["livenessProbe"], "tcpSocket": {"port": "http"}}
    for _, spec, _ in pod_specs(docs):
        for c in spec["containers"]:
            assert "http" in {p["name"] for p in c["ports"]}


def test_accelerator_switch(case):
    name, _, docs, vals = case
    device, resource = SWITCH[vals["accelerator"]]
    for component in ("prefill", "decode"):
        n = vals[component]["tensorParallelSize"]   # devices per pod = tensor-parallel ranks
        c, _ = container(docs, component)
        args = c["args"]
        assert args[args.index("--device") + 1] == device
        assert args[args.index("--tensor-parallel-size") + 1] == str(n)
        res = c["resources"]
        for part in ("requests", "limits"):
            present = ACCEL_RESOURCES & set(res.get(part, {}))
            if resource is None:
                assert not present, (name, component, part)
            else:
                assert present == {resource}, (name, component, part)
                assert res[part][resource] == n
        if device == "cpu":
            assert "--kv-cache-gib" in args and "--gpu-memory-utilization" not in args
        else:
            assert "--kv-cache-gib" not in args
    c, _ = container(docs, "dispatcher")
    assert not ACCEL_RESOURCES & set(c["resources"].get("limits", {}))


def test_keys_only_from_secrets(case):
    """No Secret is rendered (no key passes through Helm), every key file is a mounted Secret
    named in the values, and each worker role gets only its half of the CURVE keys."""
    name, _, docs, vals = case
    s = vals["secrets"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    text = "\n".join(yaml.safe_dump(d) for d in docs)
    assert "secret-key" not in text and not re.search(r"\bsk-\w", text)
    expect = {
        "dispatcher": {"api-keys": (s["apiKeys"], {s["apiKeysFile"]: s["apiKeysFile"]}),
                       "worker-key": (s["workerKey"], {"worker.key": "worker.key"})},
        "prefill": {"worker-key": (s["workerKey"], {"worker.key": "worker.key"}),
                    "kv-keys": (s["kvPrefill"], {"client.key_secret": "client.key_secret",
                                                 "server.key": "server.key"})},
        "decode": {"worker-key": (s["workerKey"], {"worker.key": "worker.key"}),
                   "kv-keys": (s["kvDecode"], {"server.key_secret": "server.key_secret",
                                               **{k: f"clients/{k}" for k in s["kvClientKeys"]}})},
    }
    if vals["model"]["hfTokenSecret"]:
        expect["prefill"]["(env HF_TOKEN)"] = expect["decode"]["(env HF_TOKEN)"] = (vals["model"]["hfTokenSecret"],
                                                                                  {"HF_TOKEN": "HF_TOKEN"})
    for component, spec_, _ in pod_specs(docs):
        got = {}
        for v in spec_["volumes"]:
            if "secret" in v:
                sec = v["secret"]
                assert sec["defaultMode"] & 0o007 == 0, (component, v["name"])   # never world-readable
                got[v["name"]] = (sec["secretName"], {i["key"]: i["path"] for i in sec["items"]})
        [c] = spec_["containers"]
        for e in c.get("env", []):
            assert "value" not in e or not re.search(r"key|token|secret", e["name"], re.IGNORECASE), e
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                got[f"(env {e['name']})"] = (ref["name"], {ref["key"]: e["name"]})
        assert got == expect[component], (name, component)
        args = c["args"]
        for flag, mount in (("--api-key-file", "worker-key"), ("--worker-key-file", "worker-key"),
                            ("--kv-keys", "kv-keys"), ("--keys", "api-keys")):
            if flag in args:
                path = args[args.index(flag) + 1]
                [m] = [m for m in c["volumeMounts"] if m["name"] == mount]
                assert path.startswith(m["mountPath"]) and m["readOnly"], (component, flag)
    # which flags each role must get
    for component, flags in (("dispatcher", ("--keys", "--worker-key-file")),
                             ("prefill", ("--api-key-file", "--kv-keys")),
                             ("decode", ("--api-key-file", "--kv-keys"))):
        c, _ = container(docs, component)
        assert set(flags) <= set(c["args"]), component
        assert "--kv-insecure" not in c["args"] and "--allow-no-api-key" not in c["args"]


def test_prometheus_annotations(case):
    _, _, docs, _ = case
    specs = pod_specs(docs)
    assert {c for c, _, _ in specs} == {"dispatcher", "prefill", "decode"}
    for component, spec_, meta in specs:
        [c] = spec_["containers"]
        [port] = [p["containerPort"] for p in c["ports"] if p["name"] == "http"]
        a = meta["annotations"]
        assert a["prometheus.io/scrape"] == "true"
        assert a["prometheus.io/port"] == str(port)
        assert a["prometheus.io/path"] == "/metrics"


def test_headless_services_for_the_pools(case):
    _, _, docs, _ = case
    services, sets = by_kind(docs, "Service"), by_kind(docs, "StatefulSet")
    assert set(sets) == {f"{FULLNAME}-prefill", f"{FULLNAME}-decode"}
    for name, sts in sets.items():
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None", name
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    disp = services[f"{FULLNAME}-dispatcher"]
    assert disp["spec"].get("clusterIP") != "None"
    [dep] = by_kind(docs, "Deployment").values()
    assert disp["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_dispatcher_config_lists_the_statefulset_pods(case):
    """The dispatcher's config names exactly the StatefulSets' pods, by their stable DNS names
    through the headless Services, on the ports the containers listen on; and the dispatcher's
    own config loader accepts it."""
    from proserve.dispatcher.config import config_from_dict
    from proserve.scheduler.config import classes_from_dicts

    name, _, docs, vals = case
    data = cluster_config(docs)
    cfg = config_from_dict(data, f"{name}: cluster.json")
    cfg.validate(f"{name}: cluster.json")
    sets = by_kind(docs, "StatefulSet")
    for role, specs in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        sts = sets[f"{FULLNAME}-{role}"]
        assert sts["spec"]["replicas"] == vals[role]["replicas"] == len(specs)
        c, _ = container(docs, role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        svc = sts["spec"]["serviceName"]
        hosts = [f"{sts['metadata']['name']}-{i}.{svc}.{NAMESPACE}.svc.cluster.local" for i in range(len(specs))]
        assert [s.url for s in specs] == [f"http://{h}:{ports['http']}" for h in hosts]
        if role == "decode":
            # rank 0's KV address; rank r receives on the next ports, each a container and Service port
            assert [s.kv_addr for s in specs] == [f"tcp://{h}:{ports['kv']}" for h in hosts]
            args = c["args"]
            assert args[args.index("--kv-listen") + 1].endswith(f":{ports['kv']}")
            tp = vals["decode"]["tensorParallelSize"]
            kv = vals["decode"]["kvPort"]
            want = {"kv": kv, **{f"kv-{r}": kv + r for r in range(1, tp)}}
            assert {k: v for k, v in ports.items() if k != "http"} == want
            svc_ports = {p["name"]: (p["port"], p["targetPort"]) for p in by_kind(docs, "Service")[svc]["spec"]["ports"]}
            assert {k: v for k, v in svc_ports.items() if k != "http"} == {k: (v, k) for k, v in want.items()}
        else:
            assert {s.local_policy for s in specs} == {vals["prefill"]["localPolicy"]}
    c, _ = container(docs, "dispatcher")
    assert c["args"][c["args"].index("--config") + 1] == "/etc/proserve/config/cluster.json"
    assert data["dispatcher"]["port"] == c["ports"][0]["containerPort"]
    # the workers get the same classes as the dispatcher
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert classes_from_dicts(json.loads(cm["data"]["classes.json"]), "classes.json") == cfg.classes
    lm = vals["latencyModel"]["configMap"]
    if lm:
        path = f"/etc/proserve/latency-model/{vals['latencyModel']['key']}"
        assert {s.latency_model for s in cfg.prefill} == {path}
        c, _ = container(docs, "prefill")
        assert c["args"][c["args"].index("--latency-model") + 1] == path


def _parsers():
    from proserve.dispatcher.cli import build_parser as dispatcher_parser
    from proserve.prefill.worker import build_parser as worker_parser
    return {"dispatcher": dispatcher_parser(), "prefill": worker_parser("prefill"), "decode": worker_parser("decode")}


def test_commands_use_options_the_clis_have(case):
    """Every --flag in a container's arguments is an option of that entry point (vLLM's own
    flags after `--` excepted), and the real parser accepts the whole command line."""
    name, _, docs, vals = case
    parsers = _parsers()
    for component, spec_, _ in pod_specs(docs):
        [c] = spec_["containers"]
        assert c["command"] == ["python3", "-m", f"proserve.{component}"]
        ap = parsers[component]
        args = [a.replace("$(POD_IP)", "10.1.2.3") for a in c["args"]]
        ours = args[:args.index("--")] if "--" in args else args
        for a in ours:
            if a.startswith("--"):
                assert a.split("=", 1)[0] in ap._option_string_actions, f"{name}: {component}: {a} is no option"
        env = {e["name"] for e in c.get("env", [])}
        assert all(v in env for a in c["args"] for v in re.findall(r"\$\((\w+)\)", a))
        parsed = ap.parse_args(args)
        assert parsed.host == ("10.1.2.3" if vals["bindPodIP"] else "0.0.0.0")
        if component != "dispatcher":
            assert parsed.device == SWITCH[vals["accelerator"]][0]
            assert parsed.vllm_args in ([], ["--", *vals[component]["vllmArgs"]])


def test_network_policies(case):
    _, _, docs, vals = case
    pols = by_kind(docs, "NetworkPolicy")
    sel = {c: {"app.kubernetes.io/name": "proserve", "app.kubernetes.io/instance": RELEASE,
               "app.kubernetes.io/component": c} for c in ("dispatcher", "prefill", "decode")}
    for role in ("prefill", "decode"):
        rules = pols[f"{FULLNAME}-{role}"]["spec"]["ingress"]
        assert all(r.get("from") for r in rules), role   # nothing open to all
        by_port = {}
        for r in rules:
            for p in r["ports"]:
                by_port.setdefault(p["port"], []).extend(r["from"])
        assert {"podSelector": {"matchLabels": sel["dispatcher"]}} in by_port["http"]
        kv_ports = {"kv", *(f"kv-{r}" for r in range(1, vals["decode"]["tensorParallelSize"]))}
        if role == "decode":   # every tensor-parallel rank's KV port, from the prefill pool only
            assert set(by_port) == {"http"} | kv_ports
            for p in kv_ports:
                assert by_port[p] == [{"podSelector": {"matchLabels": sel["prefill"]}}]
        else:
            assert set(by_port) == {"http"}


#: what vllm-ascend's container guide mounts from the host besides the NPU devices
ASCEND_HOST_PATHS = {"/usr/local/dcmi": "Directory", "/usr/local/bin/npu-smi": "File",
                     "/usr/local/Ascend/driver/lib64": "Directory",
                     "/usr/local/Ascend/driver/version.info": "File", "/etc/ascend_install.info": "File"}


def test_pods_run_unprivileged(case):
    """No pod is privileged, escalates or keeps a capability. Every pod runs as a non-root
    user, except the Ascend workers, which run as root as vllm-ascend's guide runs them
    (the NPU device nodes belong to root), with the host's driver mounted read-only."""
    name, _, docs, _ = case
    npu = CASES[name].get("accelerator") == "ascend"
    for component, spec_, _ in pod_specs(docs):
        assert spec_["automountServiceAccountToken"] is False
        worker = component in ("prefill", "decode")
        root = npu and worker
        ctx = spec_["securityContext"]
        assert ctx["runAsNonRoot"] is (not root) and (ctx["runAsUser"] == 0) is root
        [c] = spec_["containers"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert not sc.get("privileged") and not sc["capabilities"].get("add")
        host = {v["name"]: v["hostPath"]["path"] for v in spec_["volumes"] if "hostPath" in v}
        kinds = {v["hostPath"]["path"]: v["hostPath"].get("type") for v in spec_["volumes"] if "hostPath" in v}
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        if root:
            # each path must exist on the node as what it is (no empty directory in its place)
            assert kinds == ASCEND_HOST_PATHS
            for vol, path in host.items():
                assert mounts[vol]["mountPath"] == path and mounts[vol]["readOnly"] is True
        else:
            assert not host


# -- the guide -------------------------------------------------------------------------------


def _guide_commands() -> tuple[list[list[str]], dict[str, str]]:
    """The shell commands of deploy/README.md's bash blocks, and the files their here-documents write."""
    text = GUIDE.read_text()
    cmds, heredocs = [], {}
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.DOTALL):
        lines = iter(re.sub(r"\\\n\s*", " ", block).splitlines())
        for line in lines:
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r"cat > (\S+) <<'?(\w+)'?", line)
            if m:
                body = []
                for body_line in lines:
                    if body_line.strip() == m.group(2):
                        break
                    body.append(body_line)
                heredocs[m.group(1)] = "\n".join(body) + "\n"
                continue
            cmds.append(shlex.split(line))
    return cmds, heredocs


def _flag_values(cmd, flag):
    out = []
    for i, a in enumerate(cmd):
        if a == flag and i + 1 < len(cmd):
            out.append(cmd[i + 1])
        elif a.startswith(flag + "="):
            out.append(a[len(flag) + 1:])
    return out


def test_guide_matches_the_chart():
    """deploy/README.md creates the Secrets the chart mounts (names and keys), installs this
    chart, and only sets values that exist."""
    vals = merged_values({})
    s = vals["secrets"]
    need = {s["workerKey"]: {"worker.key"}, s["apiKeys"]: {s["apiKeysFile"]},
            s["kvPrefill"]: {"client.key_secret", "server.key"},
            s["kvDecode"]: {"server.key_secret", *s["kvClientKeys"]}}
    made = {}
    installs = []
    commands, files = _guide_commands()
    for cmd in commands:
        if cmd[0] == "kubectl" and "secret" in cmd and "generic" in cmd:
            name = cmd[cmd.index("generic") + 1]
            made[name] = {v.split("=", 1)[0] if "=" in v else Path(v).name for v in _flag_values(cmd, "--from-file")}
        if cmd[:2] == ["helm", "install"] or cmd[:2] == ["helm", "upgrade"]:
            installs.append(cmd)
    assert made == need
    # the client keys file it writes is one the dispatcher loads
    from proserve.dispatcher.config import keys_from_dict
    from proserve.scheduler.config import classes_from_dicts
    keys_from_dict(tomllib.loads(files[s["apiKeysFile"]]), classes_from_dicts(vals["classes"], "classes"), "guide")
    assert "scripts/make_keys.sh" in {c[0] for c in commands}
    assert installs and all("deploy/helm/proserve" in cmd for cmd in installs)
    for cmd in installs:
        for item in _flag_values(cmd, "--set"):
            for kv in item.split(","):
                node = vals
                for part in kv.split("=", 1)[0].split("."):
                    assert isinstance(node, dict) and part in node, f"guide sets unknown value {kv!r}"
                    node = node[part]
    # the guide's values file example, if any, names only values that exist
    text = GUIDE.read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL):
        example = yaml.safe_load(block)
        if isinstance(example, dict) and {"accelerator", "model", "prefill"} & set(example):
            _assert_known(example, vals, "")
            documents(example)   # and it renders


def _assert_known(example: dict, vals: dict, where: str):
    for k, v in example.items():
        assert k in vals, f"guide's values example: unknown value {where}{k}"
        if isinstance(v, dict) and isinstance(vals[k], dict) and vals[k]:
            _assert_known(v, vals[k], f"{where}{k}.")


def test_main_readme_section_matches_the_chart():
    """README.md's short guide names the Secrets, keys, values and DNS names the chart uses."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Deploying on Kubernetes\n(.*?)^## ", text, re.DOTALL | re.MULTILINE)
    assert m, "README.md has no 'Deploying on Kubernetes' section"
    section = " ".join(m.group(1).split())
    vals = merged_values({})
    s = vals["secrets"]
    for name, keys in ((s["workerKey"], ["worker.key"]), (s["apiKeys"], [s["apiKeysFile"]]),
                       (s["kvPrefill"], ["client.key_secret", "server.key"]),
                       (s["kvDecode"], ["server.key_secret", *s["kvClientKeys"]])):
        assert re.search(rf"`{re.escape(name)}` \({', '.join(f'`{re.escape(k)}`' for k in keys)}\)", section), name
    for value in re.findall(r"`((?:[a-z][A-Za-z]*\.)*[a-z][A-Za-z]*)`", section):
        if "." in value and value.split(".")[0] in vals:
            node = vals
            for part in value.split("."):
                if part == "*":
                    break
                assert part in node, f"README names unknown value {value}"
                node = node[part]
    assert "helm install ps deploy/helm/proserve -n llm" in section
    docs = documents()
    cfg = cluster_config(docs)
    host = cfg["prefill"][0]["url"].removeprefix("http://")
    assert f"`{host}`" in section
    kv_port = cfg["decode"][0]["kv_addr"].rsplit(":", 1)[1]
    assert f"`tcp://…:{kv_port}`" in section
    for resource in ("nvidia.com/gpu", "huawei.com/Ascend910"):
        assert f"`{resource}`" in section
