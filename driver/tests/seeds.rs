//! Every `horovodrun` command line of Horovod's documentation, run with its training program
//! replaced by the probe worker: each either runs on this machine with every rank reporting
//! (and the flags' variables reaching the workers with Horovod's values), or is refused with a
//! message naming the flag. Remote hosts (`host1`, `server1`, …) are played by loopback
//! addresses, through an `ssh` that runs the remote command here.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use support::{example, fake_ssh, scratch};

/// The command lines, extracted from the documentation (`data/seed_commands.txt`).
fn seed_commands() -> Vec<String> {
    include_str!("data/seed_commands.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(String::from)
        .collect()
}

/// Splits a documented command line as a shell would (quotes, no expansions).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            (None, c) => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The made-up hosts of the documentation and the loopback address that plays each.
const HOSTS: &[(&str, &str)] = &[
    ("host1", "127.0.0.11"),
    ("host2", "127.0.0.12"),
    ("host3", "127.0.0.13"),
    ("host4", "127.0.0.14"),
    ("server1", "127.0.0.21"),
    ("server2", "127.0.0.22"),
    ("server3", "127.0.0.23"),
    ("server4", "127.0.0.24"),
    ("hostname1", "127.0.0.31"),
    ("hostname2", "127.0.0.32"),
    ("aa", "127.0.0.41"),
    ("bb", "127.0.0.42"),
    ("cc", "127.0.0.43"),
];

/// What the fake `ssh` does for the made-up hosts: runs the remote command on this machine,
/// its collective listener bound to the host's loopback address (so each host is a distinct
/// address, as across machines).
const FAKE_SSH: &str = r#"addr=$(awk -v h="$host" '$1 == h { print $2 }' "$HVD_TEST_HOST_MAP")
if [ -z "$addr" ]; then echo "ssh: Could not resolve hostname $host" >&2; exit 255; fi
HVD_BIND_ADDR=$addr exec sh -c "$*"
"#;

/// A directory with the files the documented commands name: `myhostfile`, the discovery
/// scripts, a `bin/ssh`, and the host map.
fn stage(name: &str) -> PathBuf {
    let dir = scratch(name);
    let exe = |p: &Path, text: &str| {
        std::fs::write(p, text).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    std::fs::write(
        dir.join("myhostfile"),
        "aa slots=2\nbb slots=2\ncc slots=2\n",
    )
    .unwrap();
    exe(
        &dir.join("discover_hosts.sh"),
        "#!/bin/sh\necho host1:4\necho host2:4\n",
    );
    exe(
        &dir.join("discover_hosts.py"),
        "#!/usr/bin/env python3\nprint('host1:4')\nprint('host2:4')\n",
    );
    fake_ssh(&dir, FAKE_SSH);
    let map: String = HOSTS.iter().map(|(h, a)| format!("{h} {a}\n")).collect();
    std::fs::write(dir.join("hosts.map"), map).unwrap();
    dir
}

/// The command's `horovodrun` arguments, with the training program replaced by the probe and
/// paths outside the scratch directory (`/path/to/…`, `/tmp/…`) moved into it.
fn probe_argv(line: &str, dir: &Path) -> Vec<String> {
    let w = words(line);
    assert_eq!(w[0], "horovodrun", "{line}");
    let program = w
        .iter()
        .position(|a| a == "python" || a == "pytest")
        .unwrap_or(w.len());
    let mut argv: Vec<String> = w[1..program]
        .iter()
        .map(|a| match a.rsplit_once('/') {
            Some((parent, file)) if parent.starts_with("/path/to") || parent == "/tmp" => {
                dir.join(file).display().to_string()
            }
            _ => a.clone(),
        })
        .collect();
    if program < w.len() {
        argv.push(example("hvd_probe"));
    }
    argv
}

/// The ranks `horovodrun` starts for this command line.
fn expected_ranks(argv: &[String]) -> usize {
    argv.iter()
        .position(|a| a == "-np")
        .map_or(1, |i| argv[i + 1].parse().unwrap())
}

/// Variables the flags of `argv` must give every worker, with Horovod's values.
fn expected_env(argv: &[String]) -> BTreeMap<&'static str, String> {
    let mut want = BTreeMap::new();
    let value = |i: usize| argv[i + 1].clone();
    for (i, a) in argv.iter().enumerate() {
        match a.as_str() {
            "--cycle-time-ms" => {
                want.insert("HOROVOD_CYCLE_TIME", value(i));
            }
            "--fusion-threshold-mb" => {
                let mb: f64 = value(i).parse().unwrap();
                want.insert(
                    "HOROVOD_FUSION_THRESHOLD",
                    format!("{}", mb * 1024.0 * 1024.0),
                );
            }
            "--cache-capacity" => {
                want.insert("HOROVOD_CACHE_CAPACITY", value(i));
            }
            "--no-hierarchical-allgather" => {
                want.insert("HOROVOD_HIERARCHICAL_ALLGATHER", "0".into());
            }
            "--autotune" => {
                want.insert("HOROVOD_AUTOTUNE", "1".into());
            }
            "--autotune-log-file" => {
                want.insert("HOROVOD_AUTOTUNE_LOG", value(i));
            }
            "--autotune-gaussian-process-noise" => {
                want.insert("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", value(i));
            }
            "--autotune-warmup-samples" => {
                want.insert("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", value(i));
            }
            "--autotune-steps-per-sample" => {
                want.insert("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", value(i));
            }
            "--autotune-bayes-opt-max-samples" => {
                want.insert("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", value(i));
            }
            "--timeline-filename" => {
                want.insert("HOROVOD_TIMELINE", value(i));
            }
            "--timeline-mark-cycles" => {
                want.insert("HOROVOD_TIMELINE_MARK_CYCLES", "1".into());
            }
            _ => {}
        }
    }
    want
}

/// Runs one documented command line; `Err` says what went wrong. Its directory is removed
/// when it passed and kept, to be read, when it failed.
fn run_seed(n: usize, line: &str) -> Result<(), String> {
    let dir = stage(&format!("seed{n}"));
    let result = check_seed(line, &dir);
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

/// Runs `line` in `dir` (made by [`stage`]) and checks what it did.
fn check_seed(line: &str, dir: &Path) -> Result<(), String> {
    let argv = probe_argv(line, dir);
    let path = format!(
        "{}:{}",
        dir.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(&argv)
        .current_dir(dir)
        .env("PATH", path)
        .env("HVD_TEST_HOST_MAP", dir.join("hosts.map"))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run horovodrun: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    let fail = |why: String| {
        Err(format!(
            "{why}\n  argv: {argv:?}\n  exit: {code:?}\n  stderr: {}",
            stderr
                .lines()
                .rev()
                .take(8)
                .collect::<Vec<_>>()
                .join("\n          ")
        ))
    };
    if argv.iter().any(|a| a.starts_with("--mpi-args")) {
        if code != Some(64) || !stderr.contains("--mpi-args") || !stderr.contains("mpirun") {
            return fail("--mpi-args must be refused (exit 64) with a message naming it".into());
        }
        return Ok(());
    }
    if argv.iter().any(|a| a == "--check-build") {
        if code != Some(0)
            || !stdout.contains("Available Frameworks:")
            || !stdout.contains("[X] Gloo")
            || !stdout.contains("[ ] NCCL")
        {
            return fail(format!("--check-build printed:\n{stdout}"));
        }
        return Ok(());
    }
    if code != Some(0) {
        return fail("the job did not succeed".into());
    }
    let topologies: Vec<serde_json::Value> = stdout
        .lines()
        .filter_map(|l| l.split_once("]<stdout>:").map(|(_, j)| j))
        .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
        .filter(|v| v["event"] == "topology")
        .collect();
    let np = expected_ranks(&argv);
    let mut ranks: Vec<u64> = topologies
        .iter()
        .filter_map(|t| t["rank"].as_u64())
        .collect();
    ranks.sort_unstable();
    if ranks != (0..np as u64).collect::<Vec<_>>() {
        return fail(format!("ranks {ranks:?} reported, not 0..{np}"));
    }
    for t in &topologies {
        if t["size"] != np {
            return fail(format!("a rank saw size {}, not {np}", t["size"]));
        }
        if t["engine"].get("Ok").is_none() {
            return fail(format!(
                "the worker could not read its engine settings: {}",
                t["engine"]
            ));
        }
        for (var, value) in expected_env(&argv) {
            if t["horovod_env"][var] != value.as_str() {
                return fail(format!(
                    "rank {} got {var}={}, not {value}",
                    t["rank"], t["horovod_env"][var]
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn every_documented_command_line_runs_or_is_refused_by_name() {
    let commands = seed_commands();
    assert!(commands.len() >= 30, "{} command lines", commands.len());
    let failures: Vec<String> = commands
        .iter()
        .enumerate()
        .filter_map(|(n, line)| run_seed(n, line).err().map(|e| format!("{line}\n  {e}")))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} command lines failed:\n{}",
        failures.len(),
        commands.len(),
        failures.join("\n\n")
    );
}

/// The fixture holds what the documentation has, where the documentation is at hand.
#[test]
fn the_command_lines_are_those_of_the_documentation() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/seeds");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!(
            "SKIPPED: {} is not here; the fixture data/seed_commands.txt stands alone",
            dir.display()
        );
        return;
    };
    let mut found = std::collections::BTreeSet::new();
    for e in entries.flatten() {
        if e.path().extension().is_none_or(|x| x != "txt") {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let mut rest = *l;
            while let Some(at) = rest.find("horovodrun ") {
                let tail = &rest[at..];
                rest = &rest[at + 11..];
                let next = tail[11..].chars().next();
                if !matches!(next, Some('-' | 'p')) {
                    continue;
                }
                let mut cmd = tail
                    .split('`')
                    .next()
                    .unwrap_or(tail)
                    .trim_end()
                    .to_string();
                let mut j = i;
                while cmd.ends_with('\\') && j + 1 < lines.len() {
                    j += 1;
                    cmd.pop();
                    cmd = format!("{} {}", cmd.trim_end(), lines[j].trim());
                }
                found.insert(cmd.split_whitespace().collect::<Vec<_>>().join(" "));
            }
        }
    }
    let fixture: std::collections::BTreeSet<String> = seed_commands().into_iter().collect();
    assert_eq!(
        found, fixture,
        "data/seed_commands.txt differs from the documentation"
    );
}
