//! `horovodrun` end to end with real worker processes on 127.0.0.x "hosts": exit codes,
//! output prefixes, hostfiles, failures that stop the job, and no process left behind.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use support::assert_probe_lines;

fn horovodrun() -> Command {
    Command::new(env!("CARGO_BIN_EXE_horovodrun"))
}

/// The probe worker, built with the workspace's examples (`cargo test --workspace`).
fn probe() -> String {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let p: PathBuf = dir.join("examples").join("hvd_probe");
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`, which builds the examples",
        p.display()
    );
    p.display().to_string()
}

fn run(args: &[&str]) -> Output {
    horovodrun().args(args).output().expect("run horovodrun")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn alive(pid: i32) -> bool {
    // Signal 0 checks existence; a zombie not yet reaped by its parent counts as gone.
    if kill(Pid::from_raw(pid), None).is_err() {
        return false;
    }
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
        .unwrap_or(false)
}

fn topologies(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| l.split_once(":{").map(|(_, j)| format!("{{{j}")))
        .filter_map(|j| serde_json::from_str::<serde_json::Value>(&j).ok())
        .filter(|v| v["event"] == "topology")
        .collect()
}

fn pids_in(stdout: &str) -> Vec<i32> {
    topologies(stdout)
        .iter()
        .filter_map(|v| v["pid"].as_i64())
        .map(|p| p as i32)
        .collect()
}

/// Starts horovodrun and collects its stdout lines through a channel while it runs.
struct Running {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(args: &[&str]) -> Self {
        let mut child = horovodrun()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits until `n` workers have printed their topology; returns their pids by rank.
    fn wait_for_workers(&mut self, n: usize) -> Vec<i32> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let pids = pids_in(&self.seen.join("\n"));
            if pids.len() >= n {
                let mut by_rank = vec![0; n];
                for l in &self.seen {
                    if let Some((_, j)) = l.split_once(":{")
                        && let Ok(v) = serde_json::from_str::<serde_json::Value>(&format!("{{{j}"))
                    {
                        by_rank[v["rank"].as_u64().expect("rank") as usize] =
                            v["pid"].as_i64().expect("pid") as i32;
                    }
                }
                return by_rank;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "workers did not start: {:?}", self.seen);
            if let Ok(l) = self.lines.recv_timeout(left) {
                self.seen.push(l);
            }
        }
    }

    fn finish(mut self) -> (Option<i32>, String, Duration) {
        let t = Instant::now();
        let deadline = t + Duration::from_secs(30);
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                break st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("horovodrun did not exit");
            }
            thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            std::io::Read::read_to_string(&mut e, &mut err).expect("stderr");
        }
        (status.code(), err, t.elapsed())
    }
}

fn assert_all_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &left {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
    assert!(left.is_empty(), "workers survived the launcher: {left:?}");
}

#[test]
fn four_workers_on_two_hosts_succeed_with_prefixed_output() {
    let p = probe();
    let out = run(&[
        "-np",
        "4",
        "-H",
        "127.0.0.2:2,127.0.0.3:2",
        &p,
        "--lines",
        "2",
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_probe_lines(&stdout, &stderr, 4, 2);
    let mut topo: Vec<serde_json::Value> = stdout
        .lines()
        .filter_map(|l| l.split_once(":{").map(|(_, j)| format!("{{{j}")))
        .filter_map(|j| serde_json::from_str(&j).ok())
        .collect();
    topo.sort_by_key(|v| v["rank"].as_u64());
    let got: Vec<(u64, u64, u64, u64, &str)> = topo
        .iter()
        .map(|v| {
            (
                v["local_rank"].as_u64().unwrap(),
                v["local_size"].as_u64().unwrap(),
                v["cross_rank"].as_u64().unwrap(),
                v["cross_size"].as_u64().unwrap(),
                v["hostname"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (0, 2, 0, 2, "127.0.0.2"),
            (1, 2, 0, 2, "127.0.0.2"),
            (0, 2, 1, 2, "127.0.0.3"),
            (1, 2, 1, 2, "127.0.0.3")
        ]
    );
    assert!(topo.iter().all(|v| v["homogeneous"] == true));
}

#[test]
fn a_failing_rank_fails_the_job_with_its_code_and_host() {
    let p = probe();
    let out = run(&[
        "-np",
        "3",
        "-H",
        "127.0.0.2:1,127.0.0.3:2",
        &p,
        "--exit-code",
        "7",
        "--on-rank",
        "2",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(
        stderr.contains("rank 2 on host 127.0.0.3 exited with code 7"),
        "{stderr}"
    );
}

#[test]
fn a_killed_worker_fails_the_job_and_leaves_no_process_behind() {
    let p = probe();
    let mut job = Running::start(&[
        "-np",
        "3",
        "-H",
        "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1",
        &p,
        "--allreduce-loop",
    ]);
    let pids = job.wait_for_workers(3);
    thread::sleep(Duration::from_millis(200)); // well inside the allreduce loop
    kill(Pid::from_raw(pids[1]), Signal::SIGKILL).expect("kill rank 1");
    let (code, stderr, took) = job.finish();
    assert_ne!(code, Some(0), "{stderr}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(
        stderr.contains("rank 1 on host 127.0.0.3 was killed by signal 9"),
        "{stderr}"
    );
    assert_all_gone(&pids);
}

#[test]
fn a_hung_worker_is_stopped_within_two_seconds_of_a_failure() {
    let p = probe();
    // Rank 0 hangs after its allreduce, rank 1 fails: rank 0 must not keep the job alive.
    let mut job = Running::start(&[
        "-np",
        "2",
        "-H",
        "127.0.0.2:2",
        &p,
        "--hang",
        "--hang-rank",
        "0",
        "--exit-code",
        "5",
        "--on-rank",
        "1",
    ]);
    let pids = job.wait_for_workers(2);
    let (code, stderr, took) = job.finish();
    assert_eq!(code, Some(5), "{stderr}");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_all_gone(&pids);
}

#[test]
fn sigterm_and_sigint_stop_every_worker() {
    let p = probe();
    for (sig, code) in [(Signal::SIGTERM, 143), (Signal::SIGINT, 130)] {
        let mut job = Running::start(&["-np", "3", "-H", "127.0.0.2:3", &p, "--hang"]);
        let pids = job.wait_for_workers(3);
        kill(Pid::from_raw(job.child.id() as i32), sig).expect("signal horovodrun");
        let (got, stderr, took) = job.finish();
        assert_eq!(got, Some(code), "{stderr}");
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert!(stderr.contains("all workers were stopped"), "{stderr}");
        assert_all_gone(&pids);
    }
}

#[test]
fn workers_exit_when_the_launcher_is_killed_outright() {
    let p = probe();
    let mut job = Running::start(&["-np", "2", "-H", "127.0.0.2:2", &p, "--hang"]);
    let pids = job.wait_for_workers(2);
    job.child.kill().expect("SIGKILL horovodrun");
    let _ = job.child.wait();
    // No signal reaches them: they notice the closed driver connection.
    assert_all_gone(&pids);
}

#[test]
fn too_many_processes_is_refused_before_anything_starts() {
    let out = run(&[
        "-np",
        "5",
        "-H",
        "127.0.0.2:2,127.0.0.3:2",
        "/nonexistent/never-started",
    ]);
    assert_eq!(out.status.code(), Some(64));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("-np 5 is larger than the 4 slots available on 127.0.0.2:2,127.0.0.3:2"),
        "{stderr}"
    );
}

#[test]
fn hostfiles_are_parsed_and_bad_ones_are_named() {
    let dir = std::env::temp_dir().join(format!("hvd-hostfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let good = dir.join("hosts");
    std::fs::write(
        &good,
        "# two local hosts\n127.0.0.5 slots=1\n\n127.0.0.6 slots=1  # second\n",
    )
    .expect("write");
    let p = probe();
    let out = run(&["-np", "2", "--hostfile", good.to_str().unwrap(), &p]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("\"hostname\":\"127.0.0.6\""));

    let bad = dir.join("bad");
    std::fs::write(&bad, "127.0.0.5 slots=1\n127.0.0.6 slots=lots\n").expect("write");
    let out = run(&["-np", "2", "--hostfile", bad.to_str().unwrap(), &p]);
    assert_eq!(out.status.code(), Some(64));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(
            ":2: bad hostfile line '127.0.0.6 slots=lots': slots 'lots' is not a positive integer"
        ),
        "{stderr}"
    );
    let out = run(&[
        "-np",
        "2",
        "--hostfile",
        dir.join("missing").to_str().unwrap(),
        &p,
    ]);
    assert_eq!(out.status.code(), Some(64));
    assert!(text(&out.stderr).contains("reading hostfile"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_flags_are_usage_errors() {
    let out = run(&["-np", "2", "--no-such-flag", "x"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(text(&out.stderr).contains("--no-such-flag"));
    let out = run(&["-np", "2", "-H", "127.0.0.2:0", "x"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(text(&out.stderr).contains("bad -H entry '127.0.0.2:0'"));
}

/// In an LSF job (`LSB_JOBID` set) with no -H, --hostfile or -np, the hosts and -np are the
/// job's, from `LSB_MCPU_HOSTS`; a malformed value is a usage error that names it.
#[test]
fn an_lsf_job_runs_on_the_hosts_lsf_gave_it() {
    let p = probe();
    let probe_args = [p.as_str(), "--lines", "1"];
    let lsf = |hosts: &str, args: &[&str]| {
        horovodrun()
            .args(args)
            .env("LSB_JOBID", "4242")
            .env("LSB_MCPU_HOSTS", hosts)
            .env_remove("LSB_HOSTS")
            .env_remove("CSM_ALLOCATION_ID")
            .output()
            .expect("run horovodrun")
    };
    let out = lsf("127.0.0.1 2", &probe_args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_probe_lines(&stdout, &stderr, 2, 1);
    let topo = topologies(&stdout);
    assert_eq!(topo.len(), 2, "{stdout}");
    for v in &topo {
        assert_eq!(
            (v["size"].as_u64(), v["local_size"].as_u64()),
            (Some(2), Some(2))
        );
        assert_eq!(v["hostname"], "127.0.0.1");
    }

    // Elastic too: the job's hosts are a fixed host set, its slots -np.
    let counter = support::example("elastic_counter");
    let args = ["--min-np", "1", &counter, "--steps", "20", "--step-ms", "5"];
    let out = lsf("127.0.0.2 2", &args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("elastic job np=2 min_np=1 max_np=2"),
        "{stderr}"
    );
    assert!(
        stderr.contains("all 2 workers of round 1 finished training"),
        "{stderr}"
    );

    let out = lsf("127.0.0.1 two", &probe_args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("LSB_MCPU_HOSTS='127.0.0.1 two': the slot count 'two'"),
        "{stderr}"
    );
}

#[test]
fn workers_that_never_register_hit_the_start_timeout() {
    let t = Instant::now();
    let out = run(&[
        "-np",
        "2",
        "-H",
        "127.0.0.2:2",
        "--start-timeout",
        "1",
        "sleep",
        "30",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("ranks [0, 1] did not register within the start timeout of 1.0s"),
        "{stderr}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn output_filename_writes_one_log_per_rank() {
    let dir = std::env::temp_dir().join(format!("hvd-logs-{}", std::process::id()));
    let p = probe();
    let out = run(&[
        "-np",
        "2",
        "-H",
        "127.0.0.2:2",
        "--output-filename",
        dir.to_str().unwrap(),
        &p,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for r in 0..2 {
        let so = std::fs::read_to_string(dir.join(format!("rank.{r}/stdout"))).expect("stdout log");
        let se = std::fs::read_to_string(dir.join(format!("rank.{r}/stderr"))).expect("stderr log");
        assert!(so.contains(&format!("out line 0 from rank {r}")), "{so}");
        assert!(se.contains(&format!("err line 0 from rank {r}")), "{se}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_timeline_records_every_rank_s_engine_ops() {
    let bench = probe().replace("hvd_probe", "fusion_bench");
    let path = std::env::temp_dir().join(format!("hvd-timeline-test-{}.json", std::process::id()));
    let p = path.display().to_string();
    let out = run(&[
        "-np",
        "2",
        "-H",
        "127.0.0.2:1,127.0.0.3:1",
        "--timeline-filename",
        &p,
        "--timeline-mark-cycles",
        &bench,
        "--tensors",
        "12",
        "--elems",
        "200000",
        "--iters",
        "1",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let trace = std::fs::read_to_string(&path).expect("timeline written");
    let _ = std::fs::remove_file(&path);
    let closed = format!("{}]", trace.trim_end().trim_end_matches(','));
    let events: Vec<serde_json::Value> = serde_json::from_str(&closed).expect("a JSON trace");
    for rank in [0, 1] {
        for phase in ["NEGOTIATE_ALLREDUCE", "QUEUE", "CYCLE"] {
            assert!(
                events
                    .iter()
                    .any(|e| e["pid"] == rank && e["name"] == phase),
                "rank {rank} has no {phase} event"
            );
        }
        assert!(
            events.iter().any(|e| e["pid"] == rank
                && e["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("ALLREDUCE"))
                && e["tid"] == "grad3"),
            "rank {rank}: no transport span for grad3"
        );
    }
}

#[test]
fn a_process_set_reduces_among_its_members_only() {
    let out = run(&[
        "-np",
        "4",
        "-H",
        "127.0.0.2:2,127.0.0.3:2",
        &probe(),
        "--process-set",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let sums: Vec<(i64, i64)> = stdout
        .lines()
        .filter_map(|l| l.split_once(":{").map(|(_, j)| format!("{{{j}")))
        .filter_map(|j| serde_json::from_str::<serde_json::Value>(&j).ok())
        .filter(|v| v["event"] == "process_set")
        .map(|v| {
            (
                v["rank"].as_i64().unwrap_or(-1),
                v["sum"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    let mut sums = sums;
    sums.sort_unstable();
    assert_eq!(sums, vec![(0, 2), (2, 2)], "{stdout}");
}

/// Two local hosts of two ranks each run allreduce hierarchically unless told not to; uneven
/// hosts cannot, even when asked (a warning says why), and the job still succeeds.
#[test]
fn hierarchical_allreduce_follows_placement_and_flags() {
    let probe = probe();
    for (hosts, flag, want) in [
        ("127.0.0.2:2,127.0.0.3:2", None, true),
        (
            "127.0.0.2:2,127.0.0.3:2",
            Some("--no-hierarchical-allreduce"),
            false,
        ),
        (
            "127.0.0.2:2,127.0.0.3:1",
            Some("--hierarchical-allreduce"),
            false,
        ),
    ] {
        let np = if want || flag == Some("--no-hierarchical-allreduce") {
            "4"
        } else {
            "3"
        };
        let mut args = vec!["-np", np, "-H", hosts];
        args.extend(flag);
        args.push(&probe);
        let out = run(&args);
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{hosts} {flag:?}: {se}");
        let modes: Vec<bool> = topologies(&so)
            .iter()
            .filter_map(|v| v["hierarchical"].as_bool())
            .collect();
        assert_eq!(modes.len(), np.parse::<usize>().unwrap(), "{so}");
        assert!(
            modes.iter().all(|&m| m == want),
            "{hosts} {flag:?}: {modes:?}"
        );
    }
    // The flat ring between the hosts, striped over three connections per peer.
    let out = run(&[
        "-np",
        "4",
        "-H",
        "127.0.0.2:2,127.0.0.3:2",
        "--no-hierarchical-allreduce",
        "--tcp-streams",
        "3",
        &probe,
        "--elems",
        "300000",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(&[
        "-np",
        "1",
        "-H",
        "127.0.0.2:1",
        "--tcp-streams",
        "16",
        &probe,
    ]);
    assert_eq!(out.status.code(), Some(64));
    assert!(
        text(&out.stderr).contains("--tcp-streams must be 1 to 15"),
        "{}",
        text(&out.stderr)
    );
    let bad = horovodrun()
        .env("HOROVOD_HIERARCHICAL_ALLREDUCE", "sometimes")
        .args(["-np", "2", "-H", "127.0.0.2:2", &probe])
        .output()
        .expect("run horovodrun");
    assert!(!bad.status.success());
    assert!(
        text(&bad.stderr).contains("HOROVOD_HIERARCHICAL_ALLREDUCE"),
        "{}",
        text(&bad.stderr)
    );
}

/// Workers ask glibc's and PyTorch's allocators for huge pages by default; `HVD_HUGE_PAGES=0`
/// turns both off, and a variable the user set is left as it is.
#[test]
fn workers_get_huge_pages_unless_told_otherwise() {
    let probe = probe();
    let tunables = "glibc.malloc.hugetlb=1";
    for (var, value, want_tunables, want_torch) in [
        (None, "", Some(tunables), Some("1")),
        (Some("HVD_HUGE_PAGES"), "0", None, None),
        (
            Some("GLIBC_TUNABLES"),
            "glibc.malloc.check=0",
            Some("glibc.malloc.check=0"),
            Some("1"),
        ),
        (Some("THP_MEM_ALLOC_ENABLE"), "0", Some(tunables), Some("0")),
    ] {
        let mut cmd = horovodrun();
        cmd.env_remove("GLIBC_TUNABLES")
            .env_remove("HVD_HUGE_PAGES")
            .env_remove("THP_MEM_ALLOC_ENABLE");
        if let Some(v) = var {
            cmd.env(v, value);
        }
        let fallbacks = hvd_collectives::thp_fault_fallbacks();
        let out = cmd
            .args(["-np", "2", "-H", "127.0.0.2:2", &probe])
            .output()
            .expect("run horovodrun");
        assert!(out.status.success(), "{}", text(&out.stderr));
        // A kernel short of free huge pages backs an advised buffer with small ones.
        let short = hvd_collectives::thp_fault_fallbacks() > fallbacks;
        let seen: Vec<(Option<String>, Option<String>)> = topologies(&text(&out.stdout))
            .iter()
            .map(|v| {
                let get = |k: &str| v[k].as_str().map(str::to_string);
                (get("glibc_tunables"), get("thp_mem_alloc_enable"))
            })
            .collect();
        let want = (
            want_tunables.map(str::to_string),
            want_torch.map(str::to_string),
        );
        assert_eq!(seen, vec![want; 2], "{var:?}={value}");
        // Each worker says whether its malloc honoured the request (glibc 2.35/2.36 ignore it
        // in some processes), and that answer matches the pages a touched buffer got.
        let madvise = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|m| m.contains("[madvise]"));
        for t in topologies(&text(&out.stdout)) {
            let (honoured, kb) = (
                t["malloc_huge_pages"].as_bool(),
                t["malloc_huge_kb"].as_u64(),
            );
            match (want_tunables == Some(tunables) && madvise, honoured) {
                (true, Some(true)) => assert!(short || kb > Some(0), "{var:?}={value}: {t}"),
                (true, Some(false)) => assert_eq!(kb, Some(0), "{var:?}={value}: {t}"),
                (false, None) => {}
                other => panic!("{var:?}={value}: {other:?} in {t}"),
            }
        }
    }
}
