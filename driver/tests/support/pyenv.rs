//! The test virtualenv: `target/pyenv` with torch from PyPI (`python/requirements-test.txt`)
//! and the `hvd` package built from `./python` by maturin, both installed on first use and
//! shared by every test binary that runs Python; and Debian's `g++`, which `hvd.tensorflow`
//! compiles its TensorFlow op with, installed with apt when missing.

// metrics.rs loads this file a second time, through the promtool support.
#[allow(clippy::duplicate_mod)]
#[path = "../../../store/tests/support/debian.rs"]
mod debian;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// The cargo target directory these tests were built into.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    // target/<profile>/deps/<test>
    exe.ancestors().nth(3).expect("target dir").to_path_buf()
}

fn run(cmd: &mut Command, what: &str) -> Result<Output, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: cannot run {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The virtualenv's interpreter, with torch and the package installed from this checkout.
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match PYTHON.get_or_init(set_up) {
        Ok(p) => p,
        Err(e) => panic!("setting up the Python environment: {e}"),
    }
}

fn set_up() -> Result<PathBuf, String> {
    // hvd.tensorflow compiles its TensorFlow op with the C++ compiler at first use; a fresh
    // machine may have gcc without g++.
    debian::installed("c++", "g++");
    let venv = target_dir().join("pyenv");
    // Test binaries run side by side: one installs while the others wait for it.
    let lock = std::fs::File::create(target_dir().join("pyenv.lock"))
        .map_err(|e| format!("creating the virtualenv's lock file: {e}"))?;
    lock.lock()
        .map_err(|e| format!("locking the virtualenv: {e}"))?;
    let bin = venv.join("bin");
    let python = bin.join("python");
    let ready = python.exists()
        && Command::new(&python)
            .args([
                "-c",
                "import torch, torchvision, numpy, maturin, packaging, cloudpickle, tensorflow, keras, tf_keras, jax, optax, flax.linen",
            ])
            .output()
            .is_ok_and(|o| o.status.success());
    if !ready {
        eprintln!("installing torch into {} (first use)", venv.display());
        if !python.exists() {
            run(
                Command::new("python3").args(["-m", "venv"]).arg(&venv),
                "creating the virtualenv",
            )?;
        }
        run(
            Command::new(bin.join("pip"))
                .args(["install", "--quiet", "--no-cache-dir", "--no-deps", "-r"])
                .arg(root().join("python/requirements-test.txt")),
            "installing torch",
        )?;
    }
    // maturin builds the native module with cargo into a target directory of its own (the
    // package is not a workspace member), found again on the next run.
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    run(
        Command::new(bin.join("pip"))
            .args([
                "install",
                "--quiet",
                "--no-build-isolation",
                "--no-deps",
                "--force-reinstall",
            ])
            .arg(root().join("python"))
            .env("PATH", path)
            .env("CARGO_TARGET_DIR", target_dir().join("python")),
        "building and installing ./python",
    )?;
    Ok(python)
}

/// The Python script `script` (from the repository's root) with `args`, run by the test
/// virtualenv's interpreter as an elastic job over `hosts` (what discovery prints).
pub fn elastic_script(
    name: &str,
    hosts: &[&str],
    flags: &[&str],
    script: &str,
    args: &[&str],
) -> super::Job {
    elastic_script_with_env(name, hosts, flags, script, args, &[])
}

/// [`elastic_script`] with `env` set on the `horovodrun` command (its workers inherit it).
pub fn elastic_script_with_env(
    name: &str,
    hosts: &[&str],
    flags: &[&str],
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> super::Job {
    let dir = super::scratch(name);
    std::fs::write(dir.join("hosts"), hosts.join("\n") + "\n").expect("hosts");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.args(flags)
        .args(["--host-discovery-script"])
        .arg(dir.join("discover.sh"))
        .args(["--discovery-interval", "0.2"])
        .arg(python())
        .arg(root().join(script))
        .args(args)
        .envs(env.iter().copied());
    super::Job::spawn(dir, cmd)
}

/// Runs `script` (under `python/tests/`) with the test virtualenv's interpreter as `np` ranks
/// on this host, for each `np` of `nps`, through `horovodrun`; the job must succeed and every
/// rank print `<what> ok: rank R of N`.
pub fn passes_on(script: &str, what: &str, nps: &[usize]) {
    passes_on_with(script, what, nps, &[], Duration::from_secs(900));
}

/// [`passes_on`] with `env` set for the job, each run stopped after `limit`.
pub fn passes_on_with(
    script: &str,
    what: &str,
    nps: &[usize],
    env: &[(&str, &str)],
    limit: Duration,
) {
    for &np in nps {
        let (code, text) = run_ranks(np, script, env, limit);
        assert_eq!(
            code,
            Some(0),
            "{np} ranks {env:?} (None: stopped after {limit:?}):\n{text}"
        );
        for rank in 0..np {
            assert!(
                text.contains(&format!("{what} ok: rank {rank} of {np}")),
                "{np} ranks {env:?}, rank {rank}:\n{text}"
            );
        }
    }
}

/// Runs `python/tests/<script>` as `np` ranks on this host through `horovodrun`, with `env`
/// set, stopped (SIGTERM, which stops its workers) after `limit`; returns its exit code (None
/// when it was stopped) and its output, stdout then stderr.
fn run_ranks(
    np: usize,
    script: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> (Option<i32>, String) {
    let tag: String = env.iter().map(|(_, v)| format!("-{v}")).collect();
    let dir = super::scratch(&format!("{script}-{np}{tag}"));
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["-np", &np.to_string(), "-H", &format!("127.0.0.1:{np}")])
        .arg(python())
        .arg(root().join("python/tests").join(script))
        .envs(env.iter().copied())
        .stdout(Stdio::from(
            std::fs::File::create(&out).expect("stdout file"),
        ))
        .stderr(Stdio::from(
            std::fs::File::create(&err).expect("stderr file"),
        ))
        .spawn()
        .expect("horovodrun");
    let deadline = Instant::now() + limit;
    let code = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status.code();
        }
        if Instant::now() > deadline {
            super::signal(child.id() as i32, nix::sys::signal::Signal::SIGTERM);
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = format!(
        "{}\n{}",
        std::fs::read_to_string(&out).unwrap_or_default(),
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    let _ = std::fs::remove_dir_all(&dir);
    (code, text)
}
