//! `horovodrun --launcher agent` end to end: real `hvd-agent` processes on 127.0.0.2 and
//! 127.0.0.3 (one free port, the same on both), static and elastic jobs of the example
//! programs started through them, a worker and a whole agent killed on their host (also while
//! its workers start, before they register), a worker frozen (killed through its agent), a
//! wrong secret, an unreachable agent, and a driver that dies while its agents run its workers.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use support::{
    Agent, Job, SECRET_VAR, agents, alive, assert_probe_lines, check_counter, children_of, example,
    running_after, scratch, signal,
};

const HOSTS2: &[&str] = &["127.0.0.2:2", "127.0.0.3:2"];
const COUNTER: &[&str] = &["--steps", "250", "--commit-every", "5", "--step-ms", "10"];

/// Processes whose parent is `parent`.
fn children(parent: u32) -> Vec<i32> {
    children_of(&[parent])
}

fn wait_gone(pids: &[i32], what: &str) {
    let left = running_after(pids, Duration::from_secs(10));
    assert!(left.is_empty(), "{what}: {left:?} still running");
}

/// An elastic counter job through agents listening on `port`.
fn elastic_job(name: &str, hosts: &[&str], flags: &[&str], port: u16, secret: &str) -> Job {
    let port = port.to_string();
    let mut all = vec!["--launcher", "agent", "--agent-port", &port];
    all.extend_from_slice(flags);
    Job::start_env(
        scratch(name),
        hosts,
        &all,
        "elastic_counter",
        COUNTER,
        &[(SECRET_VAR, secret)],
    )
}

#[test]
fn a_static_job_runs_every_rank_through_the_agents() {
    let secret = format!("static-{}", std::process::id());
    let (agents, port) = agents(&["127.0.0.2", "127.0.0.3"], &secret);
    let out = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["--launcher", "agent", "--agent-port", &port.to_string()])
        .args(["-np", "4", "-H", "127.0.0.2:2,127.0.0.3:2"])
        .args([&example("hvd_probe"), "--lines", "2"])
        .env(SECRET_VAR, &secret)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_probe_lines(&stdout, &stderr, 4, 2);
    for a in &agents {
        // The agent reports an exit to the driver before it logs it: the job may have ended
        // a moment before the last line is written.
        a.wait_log("code=Some(0)", 2);
        let log = a.log();
        assert_eq!(log.matches("process started").count(), 2, "{log}");
        assert_eq!(log.matches("code=Some(0)").count(), 2, "{log}");
    }
}

/// Agents on 127.0.0.2 and 127.0.0.3 and an elastic counter job of 4 workers on them (min 2),
/// trained to step 20.
fn four_workers_on_two_agents(name: &str) -> (Vec<Agent>, u16, Job) {
    let secret = format!("{name}-{}", std::process::id());
    let (agents, port) = agents(&["127.0.0.2", "127.0.0.3"], &secret);
    let flags = &["-np", "4", "--min-np", "2"];
    let mut job = elastic_job(name, HOSTS2, flags, port, &secret);
    job.parents = agents.iter().map(Agent::pid).collect();
    job.wait_step(20, 4);
    (agents, port, job)
}

#[test]
fn a_worker_killed_on_its_host_shrinks_the_elastic_job_and_loses_no_step() {
    let (_agents, _, mut job) = four_workers_on_two_agents("agent-kill");
    // The workers are the agents' children, not the driver's.
    assert_eq!(job.workers().len(), 4, "{:?}", job.workers());
    signal(job.pid_of_rank(3), Signal::SIGKILL);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains("worker failed") && err.contains("killed by signal 9"),
        "{err}"
    );
    assert!(err.contains("blacklisted"), "{err}");
}

#[test]
fn a_lost_agent_fails_its_workers_and_the_job_recovers_without_it() {
    let (mut agents, port, mut job) = four_workers_on_two_agents("agent-lost");
    let orphans = job.pids_on("127.0.0.3");
    assert_eq!(orphans.len(), 2);
    let dead = agents.pop().unwrap();
    signal(dead.pid() as i32, Signal::SIGKILL);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains(&format!(
            "the hvd agent at 127.0.0.3:{port} closed the connection"
        )),
        "{err}"
    );
    // Their agent is gone, so the workers it ran exit by themselves: the driver closed their
    // rendezvous connections.
    wait_gone(&orphans, "workers of the lost agent");
}

/// A worker frozen (SIGSTOP) on an agent's host stops answering the driver's pings: after
/// `--heartbeat-timeout` the driver declares it failed and kills it through its agent (it is
/// not the driver's child), and the job trains on without its host.
#[test]
fn a_frozen_worker_is_killed_through_its_agent_and_the_job_goes_on() {
    let secret = format!("agent-frozen-{}", std::process::id());
    let (agents, port) = agents(&["127.0.0.2", "127.0.0.3"], &secret);
    let flags = &["-np", "4", "--min-np", "2", "--heartbeat-timeout", "2"];
    let mut job = elastic_job("agent-frozen", HOSTS2, flags, port, &secret);
    job.parents = agents.iter().map(Agent::pid).collect();
    job.wait_step(20, 4);
    let victim = job.pid_of_rank(3);
    let host = job
        .workers()
        .into_iter()
        .find(|w| w.0 == victim)
        .map(|w| w.2)
        .expect("the victim's host");
    let host_pids = job.pids_on(&host);
    signal(victim, Signal::SIGSTOP);
    let t = Instant::now();
    job.wait_step(1, 2);
    let took = t.elapsed();
    eprintln!("training went on at size 2 {took:?} after the SIGSTOP");
    // Killed through the agent: a stopped process dies only of SIGKILL, so nothing else
    // could have ended it.
    wait_gone(&host_pids, "the frozen worker and its host's other worker");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains("stopped answering the driver (frozen?); declared failed and killed")
            && err.contains(&format!("host={host}"))
            && err.contains("blacklisted"),
        "{err}"
    );
    assert!(took < Duration::from_secs(2 + 6), "recovery took {took:?}");
    // The agent was told to kill it, and did.
    let agent = &agents[usize::from(host == "127.0.0.3")];
    agent.wait_log(&format!("pid={victim}"), 3);
    let log = agent.log();
    let about: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(&format!("pid={victim}")))
        .collect();
    assert!(
        about.iter().any(|l| l.contains("killing process group"))
            && about.iter().any(|l| l.contains("signal=Some(9)")),
        "{about:#?}"
    );
}

#[test]
fn an_unreachable_agent_is_a_failed_host_of_the_elastic_job() {
    let secret = format!("unreachable-{}", std::process::id());
    let (_agents, port) = agents(&["127.0.0.2"], &secret);
    let hosts = &["127.0.0.2:2", "127.0.0.5:2"];
    let job = elastic_job(
        "agent-unreachable",
        hosts,
        &["-np", "2", "--max-np", "4"],
        port,
        &secret,
    );
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains(&format!(
            "could not be started: cannot reach the hvd agent at 127.0.0.5:{port}"
        )),
        "{err}"
    );
    assert!(
        err.contains("host blacklisted") && err.contains("127.0.0.5"),
        "{err}"
    );
}

#[test]
fn a_wrong_secret_is_refused_with_a_clear_message() {
    let (agents, port) = agents(&["127.0.0.2"], "the-right-one");
    let out = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["--launcher", "agent", "--agent-port", &port.to_string()])
        .args(["-np", "2", "-H", "127.0.0.2:2", &example("hvd_probe")])
        .env(SECRET_VAR, "a-wrong-one")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "could not start rank 0 on host 127.0.0.2: the hvd agent at 127.0.0.2:{port} \
             refused the connection: wrong secret"
        )),
        "{stderr}"
    );
    agents[0].wait_log("wrong secret", 1);
    let log = agents[0].log();
    assert!(
        log.contains("driver connection refused peer=127.0.0."),
        "{log}"
    );
    assert!(!log.contains("process started"), "{log}");
}

#[test]
fn without_the_secret_the_agent_launcher_is_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["--launcher", "agent", "-np", "1", "true"])
        .env_remove(SECRET_VAR)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("HVD_AGENT_SECRET"));
}

#[test]
fn agents_kill_the_workers_of_a_driver_that_died() {
    let secret = format!("orphans-{}", std::process::id());
    let (agents, port) = agents(&["127.0.0.2", "127.0.0.3"], &secret);
    // Workers that ignore SIGTERM and never register: only the agent can end them.
    let mut driver = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["--launcher", "agent", "--agent-port", &port.to_string()])
        .args([
            "-np",
            "2",
            "-H",
            "127.0.0.2:1,127.0.0.3:1",
            "--start-timeout",
            "120",
        ])
        .args(["sh", "-c", "trap '' TERM; sleep 120 & wait"])
        .env(SECRET_VAR, &secret)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut workers = Vec::new();
    for a in &agents {
        a.wait_log("process started", 1);
        let shells = children(a.pid());
        assert_eq!(shells.len(), 1, "{}", a.log());
        workers.extend(&shells);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let sleeps = children(shells[0] as u32);
            if !sleeps.is_empty() {
                workers.extend(sleeps);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the worker's child never started"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
    driver.kill().unwrap();
    driver.wait().unwrap();
    wait_gone(&workers, "workers of a dead driver");
    for a in &agents {
        assert!(
            a.log()
                .contains("stopping the processes this driver started"),
            "{}",
            a.log()
        );
        assert!(alive(a.pid() as i32), "the agent waits for the next driver");
    }
}

#[test]
fn a_failing_or_killed_rank_fails_the_static_job_and_leaves_no_process_behind() {
    let secret = format!("static-fail-{}", std::process::id());
    let (agents, port) = agents(&["127.0.0.2", "127.0.0.3"], &secret);
    let port = port.to_string();
    let horovodrun = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
        cmd.args(["--launcher", "agent", "--agent-port", &port])
            .args([
                "-np",
                "3",
                "-H",
                "127.0.0.2:1,127.0.0.3:2",
                &example("hvd_probe"),
            ])
            .args(extra)
            .env(SECRET_VAR, &secret);
        cmd
    };
    let out = horovodrun(&["--exit-code", "7", "--on-rank", "2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(
        stderr.contains("rank 2 on host 127.0.0.3 exited with code 7"),
        "{stderr}"
    );

    // Rank 1 is killed on its host while all ranks loop on allreduces.
    let mut child = horovodrun(&["--allreduce-loop"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pids = [0i32; 3];
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while pids.contains(&0) {
        let l = lines.next().expect("every rank's topology").unwrap();
        if let Some((_, j)) = l.split_once(":{") {
            let v: serde_json::Value = serde_json::from_str(&format!("{{{j}")).unwrap();
            if v["event"] == "topology" {
                pids[v["rank"].as_u64().unwrap() as usize] = v["pid"].as_i64().unwrap() as i32;
            }
        }
    }
    let all: Vec<i32> = agents.iter().flat_map(|a| children(a.pid())).collect();
    assert_eq!(all.len(), 3, "the agents run the workers");
    thread::sleep(Duration::from_millis(200));
    signal(pids[1], Signal::SIGKILL);
    thread::spawn(move || for _ in lines.map_while(Result::ok) {});
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "{stderr}");
    assert!(
        stderr.contains("rank 1 on host 127.0.0.3 was killed by signal 9"),
        "{stderr}"
    );
    wait_gone(&pids, "ranks left running after the failure");
}

/// One HTTP GET of `path` from `addr`; the status code and the parsed JSON body.
fn http_get(addr: &str, path: &[u8]) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = b"GET ".to_vec();
    req.extend_from_slice(path);
    req.extend_from_slice(b" HTTP/1.1\r\nHost: x\r\n\r\n");
    s.write_all(&req).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    (code, json)
}

#[test]
fn the_status_endpoint_answers_ipv4_and_ipv6_clients_with_json() {
    let secret = format!("status-{}", std::process::id());
    let (_agents, port) = agents(&["127.0.0.2"], &secret);
    let status_port = {
        let l = std::net::TcpListener::bind("[::]:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let sp = status_port.to_string();
    let mut job = elastic_job(
        "agent-status",
        &["127.0.0.2:2"],
        &["-np", "2", "--status-port", &sp],
        port,
        &secret,
    );
    job.wait_step(5, 2);
    let mut clients = vec![format!("127.0.0.1:{status_port}")];
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        clients.push(format!("[::1]:{status_port}"));
    }
    for addr in &clients {
        let (code, v) = http_get(addr, b"/status");
        assert_eq!(code, 200, "{addr}: {v}");
        assert_eq!(v["workers"], 2, "{addr}: {v}");
        let (code, v) = http_get(addr, "/caf\u{e9}/\"\\".as_bytes());
        assert_eq!(code, 404, "{addr}: {v}");
        assert_eq!(
            v["error"],
            "no such path: /caf\u{e9}/\"\\; try /, /status or /metrics"
        );
    }
    let (code, err, _) = job.finish();
    assert_eq!(code, 0, "{err}");
}

/// Workers whose agent dies while they start (before they register with the driver) live on,
/// orphaned; the driver counts them as lost, so when they register later they are refused and
/// exit at once instead of waiting for a round that never includes them.
#[test]
fn workers_whose_agent_died_before_they_registered_are_refused_and_exit() {
    let secret = format!("agent-early-{}", std::process::id());
    let (mut agents, port) = agents(&["127.0.0.2", "127.0.0.3"], &secret);
    let dir = scratch("agent-early");
    std::fs::write(dir.join("hosts"), HOSTS2.join("\n") + "\n").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.args(["--launcher", "agent", "--agent-port", &port.to_string()])
        .args(["-np", "2", "--max-np", "4", "--discovery-interval", "0.2"])
        .arg("--host-discovery-script")
        .arg(dir.join("discover.sh"))
        // Each worker takes 2 s before it starts and registers.
        .args([
            "sh",
            "-c",
            "sleep 2; exec \"$0\" \"$@\"",
            &example("elastic_counter"),
        ])
        .args(["--steps", "600", "--commit-every", "5", "--step-ms", "10"])
        .env(SECRET_VAR, &secret);
    let mut job = Job::spawn(dir, cmd);
    job.parents = agents.iter().map(Agent::pid).collect();
    let dead = agents.pop().unwrap();
    dead.wait_log("process started", 2);
    let orphans = children(dead.pid());
    assert_eq!(orphans.len(), 2, "{}", dead.log());
    signal(dead.pid() as i32, Signal::SIGKILL);
    drop(dead);
    job.wait_step(1, 2);
    // They woke up and registered, and the driver, done with them, refused them.
    wait_gone(&orphans, "workers of an agent lost before they registered");
    let refused = job.wait_stderr("a worker that already ended registered; refused");
    assert!(refused.contains("host=127.0.0.3"), "{refused}");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 600), 2);
    assert!(
        lines.iter().all(|l| l.v["size"] != 4),
        "no round included them"
    );
}
