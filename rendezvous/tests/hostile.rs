//! Hostile input for the rendezvous line codec: random bytes and mutations of real messages
//! (cut, flipped, repeated fields, numbers out of range, invalid UTF-8, deep nesting, lines
//! past [`MAX_LINE`]). Every line decodes to a message or to an error that says what was
//! wrong; nothing panics. The same for the handshake's lines, and for sealed lines: one
//! altered in any way is refused by its tag.
//!
//! The codec reads no stream itself: the driver and the worker read at most `MAX_LINE + 1`
//! bytes of a line before they hand it over, and a line longer than that is refused here
//! without parsing. JSON carries no length fields, and serde_json preallocates no more than
//! a small cap for a sequence, so what a line decodes to is never much larger than the line.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use hvd_rendezvous::{
    AuthMsg, DialerAuth, DriverMsg, HostsUpdate, ListenerAuth, MAX_LINE, Opener, Placement,
    ProtocolError, Sealer, WorkerMsg, decode_line, encode_line, open_line, seal_line,
};
use lines::{Edit, check, edits};
use proptest::collection::vec;
use proptest::prelude::*;

mod lines;

/// Cases per property: enough to reach every variant and mutation often, quick on two cores.
const CASES: u32 = 512;

/// Any text, newlines, quotes and control characters included.
fn text() -> impl Strategy<Value = String> {
    prop_oneof!["(?s).{0,24}", "[a-z0-9.:]{0,16}"]
}

fn worker_msg() -> impl Strategy<Value = WorkerMsg> {
    prop_oneof![
        (any::<u64>(), text(), text(), any::<u32>()).prop_map(|(worker, addr, host, pid)| {
            WorkerMsg::Register {
                worker,
                addr,
                host,
                pid,
                resume: None,
            }
        }),
        (any::<u64>(), any::<u64>(), text()).prop_map(|(worker, generation, reason)| {
            WorkerMsg::Join {
                worker,
                generation,
                reason,
            }
        }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(worker, generation)| WorkerMsg::AbortSeen { worker, generation }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(worker, generation)| WorkerMsg::Synced { worker, generation }),
        any::<u64>().prop_map(|worker| WorkerMsg::Pong { worker }),
        any::<u64>().prop_map(|worker| WorkerMsg::Goodbye { worker }),
    ]
}

fn placement() -> impl Strategy<Value = Placement> {
    any::<[usize; 6]>().prop_map(|p| Placement {
        rank: p[0],
        size: p[1],
        local_rank: p[2],
        local_size: p[3],
        cross_rank: p[4],
        cross_size: p[5],
    })
}

fn driver_msg() -> impl Strategy<Value = DriverMsg> {
    prop_oneof![
        (
            any::<u64>(),
            placement(),
            vec(text(), 0..4),
            vec(text(), 0..4),
            any::<u64>()
        )
            .prop_map(|(generation, placement, peers, hosts, updates_through)| {
                DriverMsg::World {
                    generation,
                    placement,
                    peers,
                    hosts,
                    updates_through,
                }
            }),
        (
            any::<u64>(),
            any::<u64>(),
            vec(text(), 0..4),
            vec(text(), 0..4)
        )
            .prop_map(
                |(update_id, timestamp_ms, added, removed)| DriverMsg::HostsUpdated(HostsUpdate {
                    update_id,
                    timestamp_ms,
                    added,
                    removed,
                })
            ),
        text().prop_map(|reason| DriverMsg::Removed { reason }),
        (any::<u64>(), text())
            .prop_map(|(generation, reason)| DriverMsg::Abort { generation, reason }),
        Just(DriverMsg::Ping),
        text().prop_map(|reason| DriverMsg::Refused { reason }),
    ]
}

/// Fragments a hostile peer would try: repeated and unknown fields, numbers past every
/// integer type, bad escapes, deep nesting.
const FRAGMENTS: &[&[u8]] = &[
    br#","worker":18446744073709551616"#,
    br#""pid":-1,"#,
    br#","generation":1e999"#,
    br#","type":"ping""#,
    br#","reason":"s","reason":"t""#,
    br#""\ud800""#,
    b"\\u0000",
    b"[[[[[[[[[[[[[[[[",
    b"\xff\xfe\xc3\x28\xed\xa0\x80",
];

fn mutate(line: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    lines::mutate(line, edits, FRAGMENTS)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Random bytes: refused with a message (or, rarely, a valid message).
    #[test]
    fn random_bytes_decode_or_are_refused(line in vec(any::<u8>(), 0..256)) {
        check::<WorkerMsg>(&line)?;
        check::<DriverMsg>(&line)?;
    }

    /// Random bytes after a valid opening, so parsing goes past the first byte.
    #[test]
    fn random_tails_decode_or_are_refused(tail in vec(any::<u8>(), 0..128)) {
        for head in [&br#"{"type":"register","#[..], br#"{"type":"world","placement":{"#] {
            let line = [head, &tail[..]].concat();
            check::<WorkerMsg>(&line)?;
            check::<DriverMsg>(&line)?;
        }
    }

    /// Every worker message is one line, whatever its strings hold, and decodes to itself.
    #[test]
    fn worker_messages_are_one_line_and_round_trip(msg in worker_msg()) {
        let line = encode_line(&msg).unwrap();
        prop_assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        prop_assert_eq!(line.last(), Some(&b'\n'));
        prop_assert_eq!(decode_line::<WorkerMsg>(&line).unwrap(), msg);
    }

    /// The same for every driver message.
    #[test]
    fn driver_messages_are_one_line_and_round_trip(msg in driver_msg()) {
        let line = encode_line(&msg).unwrap();
        prop_assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        prop_assert_eq!(decode_line::<DriverMsg>(&line).unwrap(), msg);
    }

    /// A worker message edited in transit: a valid message or a named error, never a panic.
    #[test]
    fn mutated_worker_messages_decode_or_are_refused(msg in worker_msg(), e in edits()) {
        let line = mutate(encode_line(&msg).unwrap(), &e);
        check::<WorkerMsg>(&line)?;
        check::<DriverMsg>(&line)?;
    }

    /// A driver message edited in transit.
    #[test]
    fn mutated_driver_messages_decode_or_are_refused(msg in driver_msg(), e in edits()) {
        let line = mutate(encode_line(&msg).unwrap(), &e);
        check::<DriverMsg>(&line)?;
        check::<WorkerMsg>(&line)?;
    }
}

/// A sealed line as its reader sees it: without its newline, its tag's hex in lower case.
fn canonical(line: &[u8]) -> Vec<u8> {
    let mut l = line.strip_suffix(b"\n").unwrap_or(line).to_vec();
    if let Some(at) = l.iter().rposition(|&b| b == b'\t') {
        l[at..].make_ascii_lowercase();
    }
    l
}

/// Both ends of one authenticated connection: the worker's sealer, the driver's opener.
fn connection() -> (Sealer, Opener) {
    let (dialer, hello) = DialerAuth::start("s").unwrap();
    let (listener, challenge) = ListenerAuth::answer("s", &hello).unwrap();
    let (proof, worker) = dialer.finish(&challenge).unwrap();
    let driver = listener.finish(&proof).unwrap();
    (worker.split().0, driver.split().1)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// A sealed line edited in transit is refused (its tag no longer checks out, or it lost
    /// its tag), unless the edit left it as it was; the connection's next genuine line is
    /// still read.
    #[test]
    fn mutated_sealed_lines_are_refused(msg in worker_msg(), e in edits()) {
        let (mut seal, mut open) = connection();
        let line = seal_line(&mut seal, &msg).unwrap();
        let edited = mutate(line.clone(), &e);
        let same = canonical(&edited) == canonical(&line);
        match open_line::<WorkerMsg>(&mut open, &edited) {
            Ok(got) => prop_assert!(same && got == msg, "accepted an edited line {:?}", edited),
            Err(err) => {
                prop_assert!(!same, "refused the genuine line: {}", err);
                prop_assert!(
                    matches!(err, ProtocolError::Auth(_) | ProtocolError::Unsealed
                        | ProtocolError::Refused(_) | ProtocolError::TooLong(_)),
                    "{}", err
                );
                prop_assert_eq!(open_line::<WorkerMsg>(&mut open, &line).unwrap(), msg);
            }
        }
    }

    /// Random bytes on an authenticated connection never reach the JSON parser.
    #[test]
    fn random_bytes_on_a_sealed_connection_are_refused(line in vec(any::<u8>(), 0..256)) {
        let (_, mut open) = connection();
        let err = open_line::<WorkerMsg>(&mut open, &line).unwrap_err();
        prop_assert!(!matches!(err, ProtocolError::Malformed(_)), "{}", err);
    }

    /// Handshake lines edited in transit, at either step: an error with a message, never a
    /// session, unless the edit left the line as it was.
    #[test]
    fn mutated_handshake_lines_are_refused(e in edits(), step in 0u8..3) {
        let (dialer, hello) = DialerAuth::start("s").unwrap();
        let hello = if step == 0 { mutate(hello, &e) } else { hello };
        let Ok((listener, challenge)) = ListenerAuth::answer("s", &hello) else {
            return Ok(());
        };
        let genuine = challenge.clone();
        let challenge = if step == 1 { mutate(challenge, &e) } else { challenge };
        let Ok((proof, _)) = dialer.finish(&challenge) else {
            return Ok(());
        };
        let proof = if step == 2 { mutate(proof, &e) } else { proof };
        if let Err(err) = listener.finish(&proof) {
            prop_assert!(!err.to_string().is_empty());
        } else if step == 1 {
            prop_assert_eq!(
                decode_line::<AuthMsg>(&challenge).unwrap(),
                decode_line::<AuthMsg>(&genuine).unwrap()
            );
        }
    }
}

/// Numbers past a field's type, and the same field twice, are refused naming the value or
/// the field.
#[test]
fn out_of_range_numbers_and_repeated_fields_are_named() {
    let cases: &[(&[u8], &str)] = &[
        (
            br#"{"type":"pong","worker":18446744073709551616}"#,
            "expected u64",
        ),
        (
            br#"{"type":"register","worker":1,"addr":"a","host":"h","pid":4294967296}"#,
            "4294967296",
        ),
        (br#"{"type":"pong","worker":-1}"#, "-1"),
        (br#"{"type":"abort","generation":1e999,"reason":"r"}"#, ""),
        (
            br#"{"type":"pong","worker":1,"worker":2}"#,
            "duplicate field `worker`",
        ),
        (br#"{"type":"pong","worker":1,"x":1}"#, "`x`"),
        (br#"{"type":"pong","secret":"s","worker":1}"#, "`secret`"),
        (br#"{"type":"exec","cmd":"rm -rf /"}"#, "`exec`"),
    ];
    for (line, named) in cases {
        let worker = decode_line::<WorkerMsg>(line).map(|_| ());
        let driver = decode_line::<DriverMsg>(line).map(|_| ());
        let err = worker.and(driver).unwrap_err().to_string();
        assert!(err.starts_with("malformed message: "), "{err}");
        assert!(err.contains(named), "{err} does not name {named}");
    }
}

/// Nesting deep enough to overflow a recursive parser's stack is an error instead.
#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    for open in [&b"["[..], br#"{"a":"#] {
        let mut line = br#"{"type":"world","peers":"#.to_vec();
        line.extend(open.repeat(100_000));
        let err = decode_line::<DriverMsg>(&line).unwrap_err().to_string();
        assert!(err.contains("recursion limit"), "{err}");
    }
}

/// A line past the limit is refused by its length, before any parsing, naming the limit.
#[test]
fn lines_past_the_limit_are_refused_unparsed() {
    let mut line = br#"{"type":"removed","reason":""#.to_vec();
    line.resize(MAX_LINE + 1, b'x');
    let err = decode_line::<DriverMsg>(&line).unwrap_err();
    assert!(
        matches!(err, ProtocolError::TooLong(n) if n == MAX_LINE + 1),
        "{err}"
    );
    assert!(err.to_string().contains(&MAX_LINE.to_string()), "{err}");
    // The longest line allowed is parsed (and found unterminated).
    line.truncate(MAX_LINE);
    let err = decode_line::<DriverMsg>(&line).unwrap_err().to_string();
    assert!(err.contains("EOF while parsing"), "{err}");
}
