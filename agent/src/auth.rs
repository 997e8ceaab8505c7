//! The shared-secret handshake: each side proves it knows the secret by returning the
//! HMAC-SHA256 of the other side's fresh nonce, so the secret never crosses the wire and a
//! recorded answer is useless on another connection. The two directions use different labels,
//! so an agent's answer can't be replayed as a driver's.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Label of the MAC the driver computes over the agent's nonce.
pub const DRIVER_LABEL: &str = "hvd-agent/driver";
/// Label of the MAC the agent computes over the driver's nonce.
pub const AGENT_LABEL: &str = "hvd-agent/agent";

/// Bytes of randomness in a nonce.
const NONCE_BYTES: usize = 16;

/// Reading randomness failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot read random bytes from /dev/urandom: {0}")]
pub struct RandomError(#[from] std::io::Error);

/// A fresh random nonce, hex encoded.
///
/// # Errors
/// When `/dev/urandom` can't be read.
pub fn nonce() -> Result<String, RandomError> {
    use std::io::Read;
    let mut b = [0u8; NONCE_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(hex(&b))
}

/// The secret could not key the MAC (HMAC takes keys of any length, so this does not happen).
#[derive(Debug, thiserror::Error)]
#[error("the secret can't key HMAC-SHA256")]
pub struct KeyError;

fn keyed(secret: &str, label: &str, nonce: &str) -> Result<HmacSha256, KeyError> {
    let mut m = HmacSha256::new_from_slice(secret.as_bytes()).map_err(|_| KeyError)?;
    m.update(label.as_bytes());
    m.update(b"\n");
    m.update(nonce.as_bytes());
    Ok(m)
}

/// The hex MAC of `nonce` under `secret` for the direction `label`.
///
/// # Errors
/// [`KeyError`], which HMAC never raises.
pub fn mac(secret: &str, label: &str, nonce: &str) -> Result<String, KeyError> {
    Ok(hex(&keyed(secret, label, nonce)?.finalize().into_bytes()))
}

/// Whether `given` is the MAC of `nonce` under `secret` for `label`; compared in constant time.
pub fn verify(secret: &str, label: &str, nonce: &str, given: &str) -> bool {
    match (unhex(given), keyed(secret, label, nonce)) {
        (Some(bytes), Ok(m)) => m.verify_slice(&bytes).is_ok(),
        _ => false,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_right_secret_verifies_and_anything_else_does_not() {
        let n = nonce().unwrap();
        assert_eq!(n.len(), 2 * NONCE_BYTES);
        assert_ne!(n, nonce().unwrap_or_default(), "nonces are fresh");
        let m = mac("s3cret", DRIVER_LABEL, &n).unwrap();
        assert!(verify("s3cret", DRIVER_LABEL, &n, &m));
        assert!(!verify("other", DRIVER_LABEL, &n, &m), "wrong secret");
        assert!(!verify("s3cret", AGENT_LABEL, &n, &m), "other direction");
        assert!(!verify("s3cret", DRIVER_LABEL, "00", &m), "other nonce");
        assert!(!verify("s3cret", DRIVER_LABEL, &n, "zz"), "not hex");
        assert!(!verify("s3cret", DRIVER_LABEL, &n, &m[..10]), "truncated");
    }

    #[test]
    fn mac_matches_an_independently_computed_vector() {
        // HMAC-SHA256 under "s3cret" of "<label>\n<nonce>", computed with OpenSSL:
        // printf 'hvd-agent/driver\n0011...eeff' | openssl dgst -sha256 -hmac s3cret
        let n = "00112233445566778899aabbccddeeff";
        assert_eq!(
            mac("s3cret", DRIVER_LABEL, n).unwrap(),
            "b0186833d4a70623177e1b1ed3cfb914e78652acc5dc1a6266474cd8f135bd8a"
        );
        assert_eq!(
            mac("s3cret", AGENT_LABEL, n).unwrap(),
            "8e9b1ab9febb243f729f9dd4c6a7804e4036a6c28335dd705c66e076ce42581e"
        );
    }
}
