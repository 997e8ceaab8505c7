//! The README and the pages under `docs/` stay true to the repository:
//!
//! - every relative link resolves: its file exists, and an `#anchor` names a heading of the
//!   target by GitHub's slug rules;
//! - every command of a ```` ```sh ```` block runs a program that exists (a file of the
//!   repository, a binary or example the workspace builds, or a common tool), names only paths,
//!   packages, binaries, examples and test targets that exist, and passes `horovodrun` only flags
//!   that `horovodrun --help` lists;
//! - CI (`.ci/run`) runs exactly the README's test command.
//!
//! Each failure names the file, the line and the link or command.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

#[path = "readme/markdown.rs"]
mod markdown;
#[path = "readme/shell.rs"]
mod shell;
#[path = "readme/workspace.rs"]
mod workspace;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use markdown::{anchors, links, slug};
use shell::commands;
use workspace::{Workspace, cargo_problems, horovodrun_flags, horovodrun_problems, program_exists};

/// Programs a documented command may run besides the repository's own.
const TOOLS: &[&str] = &[
    "apt-get", "cargo", "cd", "curl", "docker", "export", "head", "helm", "kind", "kubectl", "pip",
    "pip3", "promtool", "python", "python3", "xxd",
];

/// The repository's root.
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// README.md and every page under docs/.
fn pages() -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    docs.insert(0, root().join("README.md"));
    docs
}

/// A path as a failure message names it: relative to the repository's root.
fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Fails with every problem found, one a line.
fn report(problems: &[String]) {
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

/// The problems of one page's links: files that do not exist, anchors no heading has.
fn check_links(page: &Path, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for (line, target) in links(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
        let path = if file.is_empty() {
            page.to_path_buf()
        } else {
            page.parent().unwrap().join(file)
        };
        let at = format!("{}:{line}: link `{target}`", shown(page));
        if !file.is_empty() && !path.exists() {
            problems.push(format!("{at}: no such file {}", shown(&path)));
            continue;
        }
        if anchor.is_empty() {
            continue;
        }
        let heads = match file {
            "" => anchors(text),
            _ => fs::read_to_string(&path)
                .map(|t| anchors(&t))
                .unwrap_or_default(),
        };
        if !heads.contains(anchor) {
            let list = heads.into_iter().collect::<Vec<_>>().join(", ");
            problems.push(format!(
                "{at}: no heading of {} has the anchor `#{anchor}` ({list})",
                shown(&path)
            ));
        }
    }
    problems
}

/// The problems of one page's commands.
fn check_commands(
    page: &Path,
    text: &str,
    ws: &Workspace,
    flags: &BTreeMap<String, usize>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (line, words) in commands(text) {
        let at = format!("{}:{line}: command `{}`", shown(page), words.join(" "));
        let mut words: &[String] = &words;
        while words
            .first()
            .is_some_and(|w| w.split_once('=').is_some_and(|(k, _)| !k.starts_with('-')))
        {
            words = &words[1..]; // VAR=value before the program
        }
        let Some(program) = words.first() else {
            continue;
        };
        let is_repo_program = program.contains('/') && program_exists(program, ws);
        if !is_repo_program && !ws.bins.contains(program) && !TOOLS.contains(&program.as_str()) {
            problems.push(format!(
                "{at}: `{program}` is not a file of the repository, a binary or example the workspace builds, nor a known tool"
            ));
        }
        for w in &words[1..] {
            if w.contains('/') && !program_exists(w, ws) {
                problems.push(format!(
                    "{at}: `{w}` does not exist in the repository or the workspace's build"
                ));
            }
        }
        let args = &words[1..];
        if program.rsplit('/').next() == Some("horovodrun") {
            problems.extend(
                horovodrun_problems(args, flags)
                    .into_iter()
                    .map(|p| format!("{at}: {p}")),
            );
        } else if program == "cargo" {
            problems.extend(
                cargo_problems(args, ws)
                    .into_iter()
                    .map(|p| format!("{at}: {p}")),
            );
        }
    }
    problems
}

// === The checks ===

#[test]
fn every_relative_link_resolves() {
    let problems: Vec<String> = pages()
        .iter()
        .flat_map(|p| check_links(p, &fs::read_to_string(p).unwrap()))
        .collect();
    report(&problems);
}

#[test]
fn every_documented_command_resolves() {
    let (ws, flags) = (Workspace::read(), horovodrun_flags());
    let mut problems = Vec::new();
    for page in pages() {
        problems.extend(check_commands(
            &page,
            &fs::read_to_string(&page).unwrap(),
            &ws,
            &flags,
        ));
    }
    report(&problems);
}

#[test]
fn ci_runs_the_readme_test_command() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let first_block = readme
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap_or("");
    let test = first_block.lines().find(|l| l.starts_with("cargo test"));
    let test = test.expect("README.md: the first ```sh block has no `cargo test` command");
    let ci = fs::read_to_string(root().join(".ci/run")).unwrap();
    let ran: Vec<&str> = ci
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("cargo "))
        .collect();
    assert_eq!(
        ran,
        [test],
        ".ci/run must run exactly the README's test command `{test}`"
    );
}

// === The checkers find what they are meant to ===

#[test]
fn slugs_follow_githubs_rules() {
    assert_eq!(slug("PyTorch: `hvd.torch`"), "pytorch-hvdtorch");
    assert_eq!(
        slug("`horovodrun --launcher agent`"),
        "horovodrun---launcher-agent"
    );
    assert_eq!(
        slug("Accepted with Horovod's meaning"),
        "accepted-with-horovods-meaning"
    );
    assert_eq!(
        slug("See [the chart](x.md) — twice"),
        "see-the-chart--twice"
    );
    let heads = anchors("# A\n\n```sh\n# not a heading\n```\n## A\n#not one either\n");
    assert_eq!(heads, BTreeSet::from(["a".to_string(), "a-1".to_string()]));
}

#[test]
fn a_broken_link_is_named_with_its_file_and_line() {
    let page = root().join("docs/page.md");
    let text = "# Page\n\n[ok](#page) and `[code](nowhere.md)`\n[gone](missing.md), [elastic](elastic.md#no-such-heading)\nand [split\ntext](README.md#nope).\n";
    let problems = check_links(&page, text);
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(
        problems[0].starts_with("docs/page.md:4: link `missing.md`: no such file"),
        "{problems:#?}"
    );
    assert!(
        problems[1].starts_with("docs/page.md:4: link `elastic.md#no-such-heading`: no heading")
    );
    assert!(
        problems[2].starts_with("docs/page.md:6: link `README.md#nope`"),
        "{problems:#?}"
    );
}

#[test]
fn a_broken_command_is_named_with_its_file_and_line() {
    let (ws, flags) = (Workspace::read(), horovodrun_flags());
    let page = root().join("README.md");
    let text = "text\n\n```sh\n# a comment\nX=1 horovodrun -np 2 --min-np=1 \\\n    --no-such-flag target/release/examples/elastic_train --no-such-flag\nno-such-tool 'a b' && cargo run -p hvd-driver --example no_such_example -- --bin x\nexport S=$(head -c1 /dev/urandom | no-such-filter)\nhorovodrun -np 2 target/release/examples/nope examples/nope.py\n```\n";
    let problems = check_commands(&page, text, &ws, &flags);
    let lines: Vec<&str> = problems
        .iter()
        .map(|p| p.split(": ").next().unwrap())
        .collect();
    assert_eq!(
        lines,
        [
            "README.md:5",
            "README.md:7",
            "README.md:7",
            "README.md:8",
            "README.md:9",
            "README.md:9"
        ],
        "{problems:#?}"
    );
    assert!(
        problems[0]
            .ends_with("horovodrun has no flag `--no-such-flag` (not in `horovodrun --help`)")
    );
    assert!(problems[1].contains("`no-such-tool` is not a file of the repository"));
    assert!(problems[2].ends_with("the workspace builds no example `no_such_example`"));
    assert!(problems[3].contains("`no-such-filter`"));
    assert!(problems[4].contains("`target/release/examples/nope` does not exist"));
}
