//! Markdown, as far as the README's checks read it: paragraphs outside code blocks, inline
//! links, and the anchors GitHub gives headings.

use std::collections::{BTreeMap, BTreeSet};

/// The lines outside fenced code blocks, numbered from 1, grouped into paragraphs (a code span
/// or a link may run over a line break inside one).
fn paragraphs(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let (mut fenced, mut start, mut cur) = (false, 0, String::new());
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        if fenced || fence || line.trim().is_empty() {
            if !cur.is_empty() {
                out.push((start, std::mem::take(&mut cur)));
            }
            fenced ^= fence;
            continue;
        }
        if cur.is_empty() {
            start = i + 1;
        } else {
            cur.push('\n');
        }
        cur.push_str(line);
    }
    if !cur.is_empty() {
        out.push((start, cur));
    }
    out
}

/// `text` with its code spans blanked (same length, line breaks kept), so that brackets inside
/// them are not taken for links.
fn without_code(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let run = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut out: Vec<char> = chars.clone();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let n = run(i);
        let mut j = i + n;
        let close = loop {
            if j >= chars.len() {
                break None;
            }
            if chars[j] == '`' {
                if run(j) == n {
                    break Some(j);
                }
                j += run(j);
            } else {
                j += 1;
            }
        };
        let Some(j) = close else {
            i += n;
            continue;
        };
        for c in &mut out[i..j + n] {
            if *c != '\n' {
                *c = ' ';
            }
        }
        i = j + n;
    }
    out.into_iter().collect()
}

/// The targets of the inline links `[text](target)` of a page, with their line numbers.
pub(crate) fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (start, para) in paragraphs(text) {
        let plain = without_code(&para);
        let mut from = 0;
        while let Some(at) = plain[from..].find("](") {
            let open = from + at + 2;
            let Some(len) = plain[open..].find(')') else {
                break;
            };
            let line = start + plain[..open].matches('\n').count();
            out.push((line, plain[open..open + len].trim().to_string()));
            from = open + len;
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces made hyphens.
pub(crate) fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // A link in a heading contributes its text only.
    while let Some(at) = rest.find("](") {
        let close = rest[at..].find(')').map_or(rest.len(), |c| at + c + 1);
        text.push_str(&rest[..at]);
        rest = &rest[close..];
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a page's headings; a repeated heading gets `-1`, `-2`, … as on GitHub.
pub(crate) fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fenced || !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_default();
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}
