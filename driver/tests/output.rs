//! A Python worker's output reaches `horovodrun`'s as it is printed, not when the worker exits:
//! every worker gets `PYTHONUNBUFFERED=1` (as Horovod's launcher sets it), whatever starts it,
//! unless the user set the variable, whose value then reaches the worker unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::{Job, SECRET_VAR, agents, fake_ssh, scratch};

/// Prints one JSON line with its rank and `PYTHONUNBUFFERED` (a plain `print`, no flush),
/// then waits up to 30 s for the file named by its argument, and exits 0 (3 on a timeout).
const WORKER: &str = r#"
import json, os, sys, time
print(json.dumps({
    "event": "hello",
    "rank": int(os.environ["HOROVOD_RANK"]),
    "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
}))
deadline = time.time() + 30
while not os.path.exists(sys.argv[1]):
    if time.time() > deadline:
        sys.exit(3)
    time.sleep(0.05)
"#;

/// A scratch directory with the worker script and a `bin/ssh` that runs the remote command
/// here, in an environment holding only `PATH`, `HOME` and what the command sets itself (as
/// a remote shell would).
fn stage(name: &str) -> PathBuf {
    let dir = scratch(name);
    std::fs::write(dir.join("worker.py"), WORKER).unwrap();
    fake_ssh(
        &dir,
        "exec env -i PATH=\"$PATH\" HOME=\"$HOME\" sh -c \"$*\"\n",
    );
    dir
}

/// `horovodrun FLAGS python3 worker.py GO` in `dir`, with `bin/ssh` first on `PATH` and
/// `PYTHONUNBUFFERED` as `own` says (unset for `None`).
fn horovodrun(dir: &Path, flags: &[&str], own: Option<&str>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    let path = format!(
        "{}:{}",
        dir.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    cmd.current_dir(dir)
        .args(flags)
        .args(["python3", "worker.py"])
        .arg(dir.join("go"))
        .env("PATH", path)
        .env_remove("PYTHONUNBUFFERED");
    if let Some(v) = own {
        cmd.env("PYTHONUNBUFFERED", v);
    }
    cmd
}

/// Every rank's line must come while the workers still run (they wait for the `go` file,
/// created only after), then the job ends 0.
fn lines_come_while_the_workers_run(dir: PathBuf, flags: &[&str], ranks: u64) {
    let go = dir.join("go");
    let mut job = Job::spawn(dir.clone(), horovodrun(&dir, flags, None));
    for rank in 0..ranks {
        let line = job.wait_for(&format!("rank {rank}'s line"), |l| {
            l.v["event"] == "hello" && l.v["rank"] == rank
        });
        assert_eq!(line.v["unbuffered"], "1", "{:?}", line.v);
    }
    assert!(
        !go.exists(),
        "the workers were to wait for {}",
        go.display()
    );
    std::fs::write(&go, "").unwrap();
    let (code, err, _) = job.finish();
    assert_eq!(code, 0, "{err}");
}

#[test]
fn python_lines_reach_the_output_while_the_workers_run() {
    lines_come_while_the_workers_run(
        stage("unbuffered-static"),
        &["-np", "2", "-H", "127.0.0.1:2", "--start-timeout", "60"],
        2,
    );
}

#[test]
fn python_lines_of_an_elastic_job_reach_the_output_while_the_workers_run() {
    // The workers never join a round: they exit 0 before it, which ends the job well.
    let dir = stage("unbuffered-elastic");
    std::fs::write(dir.join("hosts"), "127.0.0.1:2\n").unwrap();
    let discover = dir.join("discover.sh").display().to_string();
    lines_come_while_the_workers_run(
        dir,
        &[
            "-np",
            "2",
            "--min-np",
            "2",
            "--host-discovery-script",
            &discover,
            "--start-timeout",
            "60",
        ],
        2,
    );
}

/// What `PYTHONUNBUFFERED` the worker of `-H host:1` saw, `own` being horovodrun's.
fn seen_by_worker(name: &str, flags: &[&str], own: Option<&str>, secret: &str) -> String {
    let dir = stage(name);
    std::fs::write(dir.join("go"), "").unwrap(); // exit at once
    let mut cmd = horovodrun(&dir, flags, own);
    cmd.env(SECRET_VAR, secret);
    let mut job = Job::spawn(dir, cmd);
    let line = job.wait_for("the worker's line", |l| l.v["event"] == "hello");
    let (code, err, _) = job.finish();
    assert_eq!(code, 0, "{err}");
    line.v["unbuffered"]
        .as_str()
        .unwrap_or("<unset>")
        .to_string()
}

#[test]
fn every_launcher_gives_the_workers_the_users_own_value_unchanged() {
    let secret = format!("unbuffered-{}", std::process::id());
    let (_agents, port) = agents(&["127.0.0.2"], &secret);
    let port = port.to_string();
    let local: &[&str] = &["-np", "1", "-H", "127.0.0.1:1"];
    let ssh: &[&str] = &["-np", "1", "-H", "node1:1"];
    let agent: &[&str] = &[
        "-np",
        "1",
        "-H",
        "127.0.0.2:1",
        "--launcher",
        "agent",
        "--agent-port",
        &port,
    ];
    for (launcher, flags) in [("local", local), ("ssh", ssh), ("agent", agent)] {
        for (own, seen) in [(None, "1"), (Some("0"), "0"), (Some(""), "")] {
            let name = format!("unbuffered-{launcher}-{}", own.map_or(9, str::len));
            assert_eq!(
                seen_by_worker(&name, flags, own, &secret),
                seen,
                "{launcher} launcher, PYTHONUNBUFFERED {own:?}"
            );
        }
    }
}
