//! Parsers for `-H` host lists and hostfiles.

/// A host and its slot count, as the user wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    /// Host name or address.
    pub host: String,
    /// Worker slots.
    pub slots: usize,
}

/// A host entry that can't be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostParseError {
    /// A `-H` entry is malformed.
    #[error("bad -H entry '{entry}': {reason}")]
    Entry {
        /// The entry as written.
        entry: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A hostfile line is malformed.
    #[error("{file}:{line}: bad hostfile line '{text}': {reason}")]
    Line {
        /// The hostfile.
        file: String,
        /// 1-based line number.
        line: usize,
        /// The line as written.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The same host appears twice.
    #[error("host '{0}' is listed more than once")]
    Duplicate(String),
    /// No host at all.
    #[error("no hosts given")]
    Empty,
}

fn parse_slots(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("slots must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("slots '{s}' is not a positive integer")),
    }
}

fn check_host(h: &str) -> Result<(), String> {
    if h.is_empty() {
        return Err("empty host name".into());
    }
    if h.chars()
        .any(|c| c.is_whitespace() || c == ',' || c == '\'' || c == '"' || c == ';')
    {
        return Err(format!(
            "host '{h}' contains a character a host name can't have"
        ));
    }
    Ok(())
}

fn no_duplicates(hosts: Vec<HostSpec>) -> Result<Vec<HostSpec>, HostParseError> {
    // A set, not a scan of the hosts before each: a hostfile of 100,000 lines would otherwise
    // take billions of comparisons.
    let mut seen = std::collections::HashSet::with_capacity(hosts.len());
    if let Some(h) = hosts.iter().find(|h| !seen.insert(h.host.as_str())) {
        return Err(HostParseError::Duplicate(h.host.clone()));
    }
    if hosts.is_empty() {
        return Err(HostParseError::Empty);
    }
    Ok(hosts)
}

/// Parses `-H`: `host[:slots]` entries separated by commas; a bare host has one slot.
///
/// # Errors
/// A [`HostParseError`] naming the bad entry.
pub fn parse_host_list(list: &str) -> Result<Vec<HostSpec>, HostParseError> {
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim) {
        let bad = |reason: String| HostParseError::Entry {
            entry: entry.into(),
            reason,
        };
        let (host, slots) = match entry.split_once(':') {
            Some((h, s)) => (h, parse_slots(s).map_err(bad)?),
            None => (entry, 1),
        };
        check_host(host).map_err(bad)?;
        out.push(HostSpec {
            host: host.into(),
            slots,
        });
    }
    no_duplicates(out)
}

/// Parses a hostfile: `host slots=N` (or `host:N`, or a bare `host` for one slot) a line;
/// blank lines and `#` comments are ignored.
///
/// # Errors
/// A [`HostParseError`] naming the file, line and problem.
pub fn parse_hostfile(file: &str, text: &str) -> Result<Vec<HostSpec>, HostParseError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |reason: String| HostParseError::Line {
            file: file.into(),
            line: i + 1,
            text: raw.trim_end().into(),
            reason,
        };
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        let (host, mut slots) = match first.split_once(':') {
            Some((h, s)) => (h, Some(parse_slots(s).map_err(bad)?)),
            None => (first, None),
        };
        for w in words {
            match w.split_once('=') {
                Some(("slots", v)) if slots.is_none() => slots = Some(parse_slots(v).map_err(bad)?),
                Some(("slots", _)) => return Err(bad("slots given twice".into())),
                _ => return Err(bad(format!("unexpected '{w}' (expected slots=N)"))),
            }
        }
        check_host(host).map_err(bad)?;
        out.push(HostSpec {
            host: host.into(),
            slots: slots.unwrap_or(1),
        });
    }
    no_duplicates(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn spec(h: &str, s: usize) -> HostSpec {
        HostSpec {
            host: h.into(),
            slots: s,
        }
    }

    #[test]
    fn host_lists() {
        assert_eq!(
            parse_host_list("127.0.0.2:2, 127.0.0.3:4,node").unwrap(),
            vec![spec("127.0.0.2", 2), spec("127.0.0.3", 4), spec("node", 1)]
        );
        for (bad, needle) in [
            ("a:0", "at least 1"),
            ("a:x", "'x' is not a positive integer"),
            ("a:1:2", "'1:2' is not"),
            (":3", "empty host"),
            ("a,,b", "empty host"),
        ] {
            let e = parse_host_list(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
        assert_eq!(
            parse_host_list("a,a:2").unwrap_err(),
            HostParseError::Duplicate("a".into())
        );
    }

    #[test]
    fn hostfiles() {
        let text = "# cluster\n\nnode1 slots=4\nnode2:2   # two gpus\r\n  node3\n";
        assert_eq!(
            parse_hostfile("hf", text).unwrap(),
            vec![spec("node1", 4), spec("node2", 2), spec("node3", 1)]
        );
        let e = parse_hostfile("hf", "a slots=2\nb slots=two\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "hf:2: bad hostfile line 'b slots=two': slots 'two' is not a positive integer"
        );
        let e = parse_hostfile("hf", "a gpus=2").unwrap_err().to_string();
        assert!(e.contains("unexpected 'gpus=2'"), "{e}");
        let e = parse_hostfile("hf", "a slots=1 slots=2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("slots given twice"), "{e}");
        assert_eq!(
            parse_hostfile("hf", "# nothing\n").unwrap_err(),
            HostParseError::Empty
        );
    }

    /// Edits of a text: cut, replace a char, insert text, repeat a span, long runs.
    pub(crate) fn mutate(text: &str, edits: &[(u8, usize, String)]) -> String {
        let mut t: Vec<char> = text.chars().collect();
        for (kind, at, ins) in edits {
            let at = at % (t.len() + 1);
            match kind {
                0 => t.truncate(at),
                1 if at < t.len() => t[at] = ins.chars().next().unwrap_or(':'),
                2 => drop(t.splice(at..at, ins.chars())),
                3 => {
                    let span: Vec<char> = t[at..(at + ins.len()).min(t.len())].to_vec();
                    t.splice(at..at, span);
                }
                _ => drop(t.splice(at..at, ins.chars().cycle().take(4096))),
            }
        }
        t.into_iter().collect()
    }

    /// What any accepted list must be: hosts a shell command and a `-H` list can carry, each
    /// once, with at least one slot.
    fn check_hosts(hosts: &[HostSpec]) -> Result<(), proptest::test_runner::TestCaseError> {
        use proptest::prelude::*;
        prop_assert!(!hosts.is_empty());
        for (i, h) in hosts.iter().enumerate() {
            prop_assert!(check_host(&h.host).is_ok() && h.slots >= 1, "{h:?}");
            prop_assert!(hosts[..i].iter().all(|o| o.host != h.host), "{h:?} twice");
        }
        Ok(())
    }

    fn edits() -> impl proptest::strategy::Strategy<Value = Vec<(u8, usize, String)>> {
        use proptest::prelude::*;
        proptest::collection::vec((0u8..5, any::<usize>(), "(?s).{0,6}"), 0..5)
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(512))]

        /// Random and edited `-H` lists: hosts that make sense, or an error quoting the entry.
        #[test]
        fn host_lists_parse_or_name_the_entry(
            list in "(?s).{0,64}|([a-z0-9.]{1,8}(:[0-9]{1,3})?,){0,5}[a-z]{1,4}",
            e in edits(),
        ) {
            let list = mutate(&list, &e);
            match parse_host_list(&list) {
                Ok(hosts) => check_hosts(&hosts)?,
                Err(HostParseError::Entry { entry, reason }) => {
                    proptest::prop_assert!(list.contains(&entry) && !reason.is_empty());
                }
                Err(HostParseError::Duplicate(h)) => {
                    proptest::prop_assert!(list.matches(&h).count() >= 2, "{h}");
                }
                Err(HostParseError::Empty) | Err(HostParseError::Line { .. }) => {
                    proptest::prop_assert!(false, "no entry at all in {list:?}");
                }
            }
        }

        /// Random and edited hostfiles: hosts that make sense, or an error naming the file,
        /// the line (as written) and what is wrong.
        #[test]
        fn hostfiles_parse_or_name_the_line(
            text in "(?s).{0,128}|([a-z0-9]{1,6}( slots=[0-9]{1,2}|:[0-9])? *(#.*)?\n){0,6}",
            e in edits(),
        ) {
            let text = mutate(&text, &e);
            match parse_hostfile("hf", &text) {
                Ok(hosts) => check_hosts(&hosts)?,
                Err(HostParseError::Line { file, line, text: quoted, reason }) => {
                    proptest::prop_assert_eq!(file, "hf");
                    let raw = text.lines().nth(line - 1).unwrap_or_default();
                    proptest::prop_assert_eq!(quoted, raw.trim_end());
                    proptest::prop_assert!(!reason.is_empty());
                }
                Err(HostParseError::Duplicate(h)) => {
                    proptest::prop_assert!(text.matches(&h).count() >= 2, "{h}");
                }
                Err(HostParseError::Empty) => {}
                Err(e @ HostParseError::Entry { .. }) => proptest::prop_assert!(false, "{e}"),
            }
        }
    }

    /// A hostfile of many hosts is parsed in linear time (a pairwise duplicate check would
    /// make 2·10^10 comparisons for this one).
    #[test]
    fn a_huge_hostfile_parses_quickly() {
        let text: String = (0..200_000).map(|i| format!("h{i} slots=1\n")).collect();
        let started = std::time::Instant::now();
        assert_eq!(parse_hostfile("hf", &text).unwrap().len(), 200_000);
        let dup = format!("{text}h7 slots=1\n");
        assert_eq!(
            parse_hostfile("hf", &dup).unwrap_err(),
            HostParseError::Duplicate("h7".into())
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }
}
