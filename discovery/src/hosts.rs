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
    for (i, h) in hosts.iter().enumerate() {
        if hosts[..i].iter().any(|o| o.host == h.host) {
            return Err(HostParseError::Duplicate(h.host.clone()));
        }
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
mod tests {
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
}
