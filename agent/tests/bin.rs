//! The `hvd-agent` binary: it refuses to start without a secret, keeps the secret from the
//! processes it starts (its environment and /proc entry included), stops them when it is told
//! to shut down, reaps the orphans it inherits, and listens on IPv6 and IPv4 at once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hvd_agent::{FromAgent, ToAgent, connect};

const T: Duration = Duration::from_secs(10);

/// A running `hvd-agent`, killed when dropped.
struct Agent {
    child: Child,
    addr: String,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent(args: &[&str], secret: Option<&str>) -> Agent {
    agent_as(args, secret, None)
}

/// An agent running as user and group `uid` when given.
fn agent_as(args: &[&str], secret: Option<&str>, uid: Option<u32>) -> Agent {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hvd-agent"));
    if !args.contains(&"--listen") {
        cmd.args(["--listen", "127.0.0.1:0"]);
    }
    cmd.args(args).env("RUST_LOG", "info");
    cmd.env_remove("HVD_AGENT_SECRET");
    if let Some(s) = secret {
        cmd.env("HVD_AGENT_SECRET", s);
    }
    if let Some(id) = uid {
        cmd.uid(id).gid(id).current_dir("/");
    }
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines
            .next()
            .expect("agent exited before listening")
            .unwrap();
        if let Some((_, a)) = l.split_once("addr=") {
            break a.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep reading its log so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
    Agent { child, addr }
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

#[test]
fn without_a_secret_it_refuses_to_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_hvd-agent"))
        .args(["--listen", "127.0.0.1:0"])
        .env_remove("HVD_AGENT_SECRET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("HVD_AGENT_SECRET") && err.contains("--secret-file"),
        "{err}"
    );
    let empty = std::env::temp_dir().join(format!("hvd-agent-empty-{}", std::process::id()));
    std::fs::write(&empty, "\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hvd-agent"))
        .args(["--listen", "127.0.0.1:0", "--secret-file"])
        .arg(&empty)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&empty);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is empty"));
}

#[tokio::test]
async fn the_secret_file_works_and_the_secret_does_not_reach_the_processes() {
    let file = std::env::temp_dir().join(format!("hvd-agent-secret-{}", std::process::id()));
    std::fs::write(&file, "from-file\n").unwrap();
    // The environment's secret is not the one in use, and must not leak either.
    let a = agent(&["--secret-file", file.to_str().unwrap()], Some("from-env"));
    let _ = std::fs::remove_file(&file);
    assert!(connect(&a.addr, "from-env", T).await.is_err());
    let (lines, _) = run_script(
        &a.addr,
        "from-file",
        "echo \"secret=${HVD_AGENT_SECRET:-unset}\"",
    )
    .await;
    assert_eq!(lines, ["secret=unset"]);
}

#[tokio::test]
async fn sigterm_stops_the_agent_and_its_processes() {
    let mut a = agent(&[], Some("s"));
    let (mut ev, mut rq) = connect(&a.addr, "s", T).await.unwrap();
    rq.send(&ToAgent::Start {
        id: 1,
        argv: vec!["sleep".into(), "30".into()],
        env: vec![],
        cwd: None,
    })
    .await
    .unwrap();
    let pid = match tokio::time::timeout(T, ev.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        FromAgent::Started { pid, .. } => pid as i32,
        other => panic!("{other:?}"),
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(a.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    // The driver hears the exit, then the agent ends.
    match tokio::time::timeout(T, ev.next()).await.unwrap().unwrap() {
        Some(FromAgent::Exited { id: 1, signal, .. }) => assert_eq!(signal, Some(15)),
        other => panic!("{other:?}"),
    }
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(st) = a.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "agent did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    assert!(!alive(pid));
}

/// Runs `script` through `sh -c` on the agent; its output lines and exit.
async fn run_script(addr: &str, secret: &str, script: &str) -> (Vec<String>, Option<i32>) {
    let (mut ev, mut rq) = connect(addr, secret, T).await.unwrap();
    rq.send(&ToAgent::Start {
        id: 1,
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![],
        cwd: None,
    })
    .await
    .unwrap();
    let mut lines = Vec::new();
    loop {
        match tokio::time::timeout(T, ev.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            FromAgent::Output { line, .. } => lines.push(line),
            FromAgent::Exited { code, .. } => return (lines, code),
            _ => {}
        }
    }
}

#[tokio::test]
async fn a_process_of_the_same_user_cannot_read_the_agents_environment() {
    // As root every /proc entry is readable: then the agent and its process run as nobody.
    let root = std::fs::metadata("/proc/self").unwrap().uid() == 0;
    let a = agent_as(&[], Some("env-secret"), root.then_some(65534));
    let (lines, code) = run_script(
        &a.addr,
        "env-secret",
        "id -u; tr '\\0' '\\n' < /proc/$PPID/environ",
    )
    .await;
    if root {
        assert_eq!(
            lines.first().map(String::as_str),
            Some("65534"),
            "{lines:?}"
        );
    }
    assert!(
        !lines.iter().any(|l| l.contains("env-secret")),
        "the agent's environment was readable: {lines:?}"
    );
    assert_ne!(code, Some(0), "{lines:?}");
}

#[tokio::test]
async fn orphans_are_reaped() {
    let a = agent(&["--reap-orphans"], Some("s"));
    // The background sleep outlives its parent: it is killed with its group, and its zombie
    // goes to the agent.
    let (lines, code) = run_script(&a.addr, "s", "sleep 30 & echo $!").await;
    assert_eq!(
        code,
        Some(0),
        "the agent's own child was waited for as usual"
    );
    let orphan: i32 = lines[0].parse().unwrap();
    let agent_pid = a.child.id().to_string();
    let adopted_zombie = || {
        std::fs::read_to_string(format!("/proc/{orphan}/stat")).is_ok_and(|s| {
            let f: Vec<&str> = s.rsplit_once(')').unwrap().1.split_whitespace().collect();
            f[0] == "Z" && f[1] == agent_pid
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    // The SIGKILL takes a moment to land; then the zombie must not stay.
    while alive(orphan) || adopted_zombie() {
        assert!(
            Instant::now() < deadline,
            "the orphan was never reaped (zombie: {})",
            adopted_zombie()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn the_ipv6_wildcard_takes_ipv4_connections_too() {
    let a = agent(&["--listen", "[::]:0"], Some("s"));
    let port = a.addr.rsplit_once(':').unwrap().1;
    let (lines, _) = run_script(&format!("127.0.0.1:{port}"), "s", "echo v4").await;
    assert_eq!(lines, ["v4"]);
    // Where the host has IPv6 (the agent fell back to 0.0.0.0 otherwise).
    if a.addr.starts_with("[::]") {
        let (lines, _) = run_script(&format!("[::1]:{port}"), "s", "echo v6").await;
        assert_eq!(lines, ["v6"]);
    } else {
        assert!(a.addr.starts_with("0.0.0.0:"), "{}", a.addr);
    }
    let help = Command::new(env!("CARGO_BIN_EXE_hvd-agent"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: [::]:7077]"), "{help}");
}
