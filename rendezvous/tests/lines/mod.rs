//! Hostile lines for the property tests of every JSON-lines decoder (the rendezvous's and the
//! agent's): edits of genuine lines, and the contract any line must meet.

#![allow(dead_code, clippy::unwrap_used)] // each test file uses a part

use hvd_rendezvous::{MAX_LINE, ProtocolError, decode_line, encode_line};
use proptest::collection::vec;
use proptest::prelude::*;

/// One edit of a line: what to do, where, and with what.
pub type Edit = (u8, usize, u8, Vec<u8>);

pub fn edits() -> impl Strategy<Value = Vec<Edit>> {
    vec(
        (0u8..8, any::<usize>(), any::<u8>(), vec(any::<u8>(), 0..12)),
        1..5,
    )
}

/// Applies `edits` to `line`: cut, flip, insert, delete, repeat a span, insert one of the
/// hostile `fragments`, insert invalid UTF-8.
pub fn mutate(mut line: Vec<u8>, edits: &[Edit], fragments: &[&[u8]]) -> Vec<u8> {
    for (kind, at, byte, bytes) in edits {
        let at = at % (line.len() + 1);
        match kind {
            0 => line.truncate(at),
            1 if at < line.len() => line[at] ^= (*byte).max(1),
            2 => drop(line.splice(at..at, bytes.iter().copied())),
            3 => drop(line.drain(at..(at + usize::from(*byte % 16)).min(line.len()))),
            4 => {
                let span = line[at..(at + usize::from(*byte)).min(line.len())].to_vec();
                line.splice(at..at, span);
            }
            5 | 6 => {
                let f = fragments[usize::from(*byte) % fragments.len().max(1)];
                line.splice(at..at, f.iter().copied());
            }
            _ => drop(line.splice(at..at, [0xff, 0xc0, 0x80])),
        }
    }
    line
}

/// The contract for any input: a message that encodes back to a line decoding to itself, or a
/// `Malformed`/`TooLong` error with a message.
pub fn check<T>(line: &[u8]) -> Result<(), TestCaseError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    match decode_line::<T>(line) {
        Ok(msg) => {
            let again = encode_line(&msg).unwrap();
            prop_assert_eq!(decode_line::<T>(&again).unwrap(), msg);
        }
        Err(e @ ProtocolError::Malformed(_)) => {
            let s = e.to_string();
            prop_assert!(
                s.starts_with("malformed message: ") && s.len() > 19,
                "{}",
                s
            );
        }
        Err(e @ ProtocolError::TooLong(_)) => {
            prop_assert!(line.len() > MAX_LINE, "{e} for {} bytes", line.len());
        }
        Err(e) => prop_assert!(false, "a plain line cannot fail with {}", e),
    }
    Ok(())
}
