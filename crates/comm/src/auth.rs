//! Proof that a peer knows the job's secret without the secret crossing the network: a
//! challenge-response with HMAC-SHA-256. Each side sends a fresh random nonce; each answers
//! with the HMAC, keyed by the secret, of what it is proving (`context`: who to whom, at which
//! epoch) and both nonces — so an eavesdropper learns neither the secret nor an answer it can
//! replay (the other side's nonce is fresh every time). The TCP rendezvous proves it both ways
//! between workers; the controller and its agents do the same over their gRPC session.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// What each side of a rendezvous connection from rank `from` to rank `to` at `epoch` proves
/// (`side`: `connect` or `accept`).
pub fn rendezvous_context(side: &str, from: usize, to: usize, epoch: u64) -> Vec<u8> {
    format!("lazarus rendezvous {side}: rank {from} to rank {to} at epoch {epoch}").into_bytes()
}

/// The length of a nonce, bytes.
pub const NONCE: usize = 16;
/// The length of a proof (an HMAC-SHA-256), bytes.
pub const PROOF: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// A fresh random nonce (from the operating system's generator).
pub fn nonce() -> std::io::Result<[u8; NONCE]> {
    use std::io::Read;
    let mut n = [0u8; NONCE];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

fn mac(secret: u128, context: &[u8], nonces: [&[u8]; 2]) -> HmacSha256 {
    let mut m = <HmacSha256 as Mac>::new_from_slice(&secret.to_le_bytes()).expect("HMAC takes a key of any length");
    // Each part with its length first: no two different inputs read as the same bytes.
    for part in [context, nonces[0], nonces[1]] {
        m.update(&(part.len() as u64).to_le_bytes());
        m.update(part);
    }
    m
}

/// The proof, by one who knows `secret`, of `context` against the two nonces (the prover's
/// peer's first: the challenge it answers).
pub fn prove(secret: u128, context: &[u8], challenge: &[u8], own: &[u8]) -> [u8; PROOF] {
    mac(secret, context, [challenge, own]).finalize().into_bytes().into()
}

/// Whether `proof` is [`prove`]'s for the same inputs, compared in constant time.
pub fn verify(secret: u128, context: &[u8], challenge: &[u8], own: &[u8], proof: &[u8]) -> bool {
    mac(secret, context, [challenge, own]).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_only_for_its_secret_context_and_nonces() {
        let (a, b) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(a, b, "nonces are fresh");
        let p = prove(7, b"ctx", &a, &b);
        assert!(verify(7, b"ctx", &a, &b, &p));
        assert!(!verify(8, b"ctx", &a, &b, &p), "another secret");
        assert!(!verify(7, b"ctx2", &a, &b, &p), "another context");
        assert!(!verify(7, b"ctx", &b, &a, &p), "the nonces swapped");
        assert!(!verify(7, b"ctx", &a, &b, &p[..31]), "cut short");
        // The secret's bytes appear nowhere in what crosses the wire.
        let secret = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210u128;
        let p = prove(secret, b"ctx", &a, &b);
        assert!(!p.windows(8).any(|w| secret.to_le_bytes().windows(8).any(|s| s == w)));
    }
}
