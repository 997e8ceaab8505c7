//! What the workspace builds and what `horovodrun` accepts, against which a documented command
//! is checked.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use crate::root;

/// What the workspace builds: its packages (with their folders), binaries and examples.
pub(crate) struct Workspace {
    pub(crate) packages: BTreeMap<String, PathBuf>,
    pub(crate) bins: BTreeSet<String>,
    pub(crate) examples: BTreeSet<String>,
}

impl Workspace {
    pub(crate) fn read() -> Self {
        let root = root();
        let manifest = fs::read_to_string(root.join("Cargo.toml")).unwrap();
        let members = manifest
            .lines()
            .find_map(|l| l.trim().strip_prefix("members = "))
            .unwrap();
        let mut ws = Workspace {
            packages: BTreeMap::new(),
            bins: BTreeSet::new(),
            examples: BTreeSet::new(),
        };
        for member in members.trim_matches(['[', ']']).split(',') {
            let dir = root.join(member.trim().trim_matches('"'));
            let (mut section, mut package, mut bins) = (String::new(), String::new(), 0);
            for line in fs::read_to_string(dir.join("Cargo.toml"))
                .unwrap()
                .lines()
                .map(str::trim)
            {
                if line.starts_with('[') {
                    section = line.to_string();
                    bins += usize::from(line == "[[bin]]");
                }
                let Some(name) = line
                    .strip_prefix("name = ")
                    .map(|n| n.trim_matches('"').to_string())
                else {
                    continue;
                };
                match section.as_str() {
                    "[package]" => package = name,
                    "[[bin]]" => {
                        ws.bins.insert(name);
                    }
                    "[[example]]" => {
                        ws.examples.insert(name);
                    }
                    _ => {}
                }
            }
            if bins == 0 && dir.join("src/main.rs").exists() {
                ws.bins.insert(package.clone());
            }
            for (sub, set) in [("src/bin", &mut ws.bins), ("examples", &mut ws.examples)] {
                for e in fs::read_dir(dir.join(sub)).into_iter().flatten().flatten() {
                    let p = e.path();
                    if p.extension().is_some_and(|x| x == "rs") {
                        set.insert(p.file_stem().unwrap().to_string_lossy().into_owned());
                    }
                }
            }
            ws.packages.insert(package, dir);
        }
        ws
    }
}

/// The flags `horovodrun --help` lists, with how many values each takes. Horovod's single-dash
/// spellings (`-np`, `-cb`, …) are listed in backticks in their long flag's description.
pub(crate) fn horovodrun_flags() -> BTreeMap<String, usize> {
    let out = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    let mut flags = BTreeMap::new();
    let mut current = 0;
    for line in help.lines() {
        let indent = line.len() - line.trim_start().len();
        let words: Vec<&str> = line.split_whitespace().collect();
        if indent <= 6 && line.trim_start().starts_with('-') {
            current = words.iter().filter(|w| w.starts_with('<')).count();
            for w in words.iter().filter(|w| w.starts_with('-')) {
                flags.insert(w.trim_end_matches(',').to_string(), current);
            }
        } else if let Some(alias) = line.trim().strip_prefix("[alias: ") {
            flags.insert(alias.trim_end_matches(']').to_string(), current);
        } else {
            for quoted in line.split('`').skip(1).step_by(2) {
                let horovod_spelling = quoted.strip_prefix('-').is_some_and(|r| {
                    !r.starts_with('-')
                        && !r.is_empty()
                        && r.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                });
                if horovod_spelling {
                    flags.insert(quoted.to_string(), current);
                }
            }
        }
    }
    assert!(
        flags.contains_key("--min-np"),
        "no flags found in `horovodrun --help`:\n{help}"
    );
    flags
}

/// Whether a path a command names is there: under `target/`, a binary or example the workspace
/// builds; under another top-level folder of the repository, a file or folder of it. Paths
/// elsewhere (the user's `./train`, `/etc/…`, URLs) are not the repository's to check.
pub(crate) fn program_exists(word: &str, ws: &Workspace) -> bool {
    let path = Path::new(word.strip_prefix("./").unwrap_or(word));
    let parts: Vec<&str> = path
        .components()
        .map(|c| match c {
            Component::Normal(s) => s.to_str().unwrap_or(""),
            _ => "",
        })
        .collect();
    match parts.as_slice() {
        ["target", "release" | "debug", name] => ws.bins.contains(*name),
        ["target", "release" | "debug", "examples", name] => ws.examples.contains(*name),
        ["target", ..] => true,
        [top, ..] if !top.is_empty() && !top.starts_with('.') && root().join(top).exists() => {
            root().join(path).exists()
        }
        _ => true,
    }
}

/// `horovodrun`'s own arguments: each flag must be one `--help` lists; the program it runs is
/// checked like any other word.
pub(crate) fn horovodrun_problems(args: &[String], flags: &BTreeMap<String, usize>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut i = 0;
    while let Some(a) = args.get(i) {
        if a.starts_with('<') {
            break; // a placeholder: `<the same arguments>`
        }
        if !a.starts_with('-') || a == "--" {
            break; // the training command
        }
        let (flag, inline) = a
            .split_once('=')
            .map_or((a.as_str(), false), |(f, _)| (f, true));
        match flags.get(flag) {
            Some(&values) => i += if inline { 1 } else { 1 + values },
            None => {
                problems.push(format!(
                    "horovodrun has no flag `{flag}` (not in `horovodrun --help`)"
                ));
                i += 1;
            }
        }
    }
    problems
}

/// `cargo`'s packages, binaries, examples and test targets must be the workspace's.
pub(crate) fn cargo_problems(args: &[String], ws: &Workspace) -> Vec<String> {
    let mut problems = Vec::new();
    let mut packages = Vec::new();
    let own = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let pairs = args[..own].windows(2);
    for pair in pairs.clone() {
        if let ("-p" | "--package", name) = (pair[0].as_str(), &pair[1]) {
            match ws.packages.get(name) {
                Some(dir) => packages.push(dir.clone()),
                None => problems.push(format!("no package `{name}` in the workspace")),
            }
        }
    }
    let dirs: Vec<&PathBuf> = if packages.is_empty() {
        ws.packages.values().collect()
    } else {
        packages.iter().collect()
    };
    for pair in pairs {
        let name = &pair[1];
        let test_exists = || {
            dirs.iter()
                .any(|d| d.join("tests").join(format!("{name}.rs")).exists())
        };
        match pair[0].as_str() {
            "--bin" if !ws.bins.contains(name) => {
                problems.push(format!("the workspace builds no binary `{name}`"));
            }
            "--example" if !ws.examples.contains(name) => {
                problems.push(format!("the workspace builds no example `{name}`"));
            }
            "--test" if !test_exists() => {
                problems.push(format!(
                    "no test target `{name}` (tests/{name}.rs) in the package"
                ));
            }
            _ => {}
        }
    }
    problems
}
