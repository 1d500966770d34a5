//! The data plane's records when it is encrypted (`--encrypt-data`): TLS 1.3 application-data
//! records (RFC 8446 §5.2) under the traffic keys of a TLS 1.3 handshake made by rustls
//! ([`super::tls`]). A frame's header is one record; its payload is records of at most 16 KiB
//! of plaintext each (none for an empty payload). A record's nonce is the key's IV XOR its
//! number on that direction (both sides count, TCP keeps the order), its additional data the
//! record's header: a record replayed, reordered, dropped, cut or altered fails to open, and
//! the connection is closed as any broken one is.
//!
//! Why the records are sealed here and not by rustls' own connection: a connection is read by
//! its reader thread and written by whichever thread sends, under the connection's write lock;
//! one rustls connection serves both directions behind one state, and a reader blocked on the
//! socket must not hold up a sender. So rustls makes the handshake and the key schedule, its
//! secrets are taken out (`dangerous_extract_secrets`, as for kernel TLS), and each direction
//! seals and opens its own records with the same AEAD (AES-256-GCM, ring).
//!
//! Without `--encrypt-data`, frames are authenticated only at the rendezvous (the peer proved
//! the secret) and travel in clear: enough on a private network, not on a shared one.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

/// The most plaintext in one record (TLS 1.3: 2^14 bytes).
pub const MAX_PLAINTEXT: usize = 1 << 14;
/// A record's header: content type, legacy version, length.
pub const RECORD_HEADER: usize = 5;
/// What a record adds to its plaintext: its header, its inner content type and its tag.
pub const RECORD_OVERHEAD: usize = RECORD_HEADER + 1 + 16;
/// The outer (and inner) content type of application data.
const APPLICATION_DATA: u8 = 0x17;
/// The inner content type of an alert (a peer's close_notify, or an error).
const ALERT: u8 = 0x15;

/// One direction's key and IV, and the number of the next record.
struct Direction {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Direction {
    fn new(key: &[u8], iv: &[u8], seq: u64) -> Option<Self> {
        let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).ok()?);
        Some(Direction { key, iv: iv.try_into().ok()?, seq })
    }

    /// The next record's nonce (RFC 8446 §5.3), counted.
    fn next_nonce(&mut self) -> Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq += 1;
        Nonce::assume_unique_for_key(n)
    }
}

/// A record's header for `plaintext` bytes of application data.
fn record_header(plaintext: usize) -> [u8; RECORD_HEADER] {
    let len = (plaintext + 1 + 16) as u16;
    let [hi, lo] = len.to_be_bytes();
    [APPLICATION_DATA, 0x03, 0x03, hi, lo]
}

/// Bytes on the wire of a frame part of `len` bytes: one record per 16 KiB or part of it.
pub fn sealed_len(len: usize) -> usize {
    len + len.div_ceil(MAX_PLAINTEXT) * RECORD_OVERHEAD
}

/// The sending half of a connection's encryption.
pub struct Sealer {
    out: Direction,
    /// The last frame sealed (its buffer reused by the next: no allocation per frame).
    frame: Vec<u8>,
}

/// The receiving half.
pub struct Opener {
    inbound: Direction,
}

/// The two halves from one TLS 1.3 handshake's AES-256-GCM traffic secrets: what this side
/// sends with (`tx`) and receives with (`rx`), each its key, IV and the number of its next record.
pub fn halves(tx: (&[u8], &[u8], u64), rx: (&[u8], &[u8], u64)) -> Option<(Sealer, Opener)> {
    Some((Sealer { out: Direction::new(tx.0, tx.1, tx.2)?, frame: Vec::new() }, Opener { inbound: Direction::new(rx.0, rx.1, rx.2)? }))
}

impl Sealer {
    /// A frame's bytes on the wire: its header sealed as one record, then its payload as
    /// records of at most [`MAX_PLAINTEXT`].
    pub fn seal_frame(&mut self, header: &[u8], payload: &[u8]) -> &[u8] {
        self.frame.clear();
        self.frame.reserve(sealed_len(header.len()) + sealed_len(payload.len()));
        for record in std::iter::once(header).chain(payload.chunks(MAX_PLAINTEXT)) {
            let head = record_header(record.len());
            self.frame.extend_from_slice(&head);
            let start = self.frame.len();
            self.frame.extend_from_slice(record);
            self.frame.push(APPLICATION_DATA);
            let nonce = self.out.next_nonce();
            let tag = self
                .out
                .key
                .seal_in_place_separate_tag(nonce, Aad::from(head), &mut self.frame[start..])
                .expect("a record within AES-GCM's limits");
            self.frame.extend_from_slice(tag.as_ref());
        }
        &self.frame
    }
}

/// Why a record did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsealed {
    /// Not the record expected here (another type or length), or it does not open: altered,
    /// replayed, reordered, or not this connection's.
    Refused,
    /// The peer closed its side with a TLS alert.
    Alert,
}

impl Opener {
    /// The plaintext length of the next record (`head`, then `body`: its ciphertext and tag),
    /// opened in place at the start of `body`, which must hold `plaintext` bytes of data.
    pub fn open(&mut self, head: &[u8; RECORD_HEADER], body: &mut [u8], plaintext: usize) -> Result<usize, Unsealed> {
        if *head != record_header(plaintext) || body.len() != plaintext + 1 + 16 {
            return Err(Unsealed::Refused);
        }
        let nonce = self.inbound.next_nonce();
        let inner = self.inbound.key.open_in_place(nonce, Aad::from(*head), body).map_err(|_| Unsealed::Refused)?;
        // The inner plaintext is the data, its content type, then zero padding (none of ours).
        let end = inner.iter().rposition(|&b| b != 0).ok_or(Unsealed::Refused)?;
        match inner[end] {
            APPLICATION_DATA if end == plaintext => Ok(end),
            ALERT => Err(Unsealed::Alert),
            _ => Err(Unsealed::Refused),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> ((Sealer, Opener), (Sealer, Opener)) {
        let (k1, k2, iv1, iv2) = ([1u8; 32], [2u8; 32], [3u8; 12], [4u8; 12]);
        (halves((&k1, &iv1, 0), (&k2, &iv2, 0)).unwrap(), halves((&k2, &iv2, 0), (&k1, &iv1, 0)).unwrap())
    }

    /// The records of a sealed frame, split as a reader reads them.
    fn records(wire: &[u8]) -> Vec<([u8; RECORD_HEADER], Vec<u8>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < wire.len() {
            let head: [u8; RECORD_HEADER] = wire[at..at + RECORD_HEADER].try_into().unwrap();
            let len = u16::from_be_bytes([head[3], head[4]]) as usize;
            out.push((head, wire[at + RECORD_HEADER..at + RECORD_HEADER + len].to_vec()));
            at += RECORD_HEADER + len;
        }
        out
    }

    #[test]
    fn a_frame_is_tls_records_of_at_most_16_kib_that_open_once_in_order() {
        let ((mut seal, _), (_, mut open)) = pair();
        let payload: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let wire = seal.seal_frame(&[9u8; 28], &payload).to_vec();
        assert_eq!(wire.len(), sealed_len(28) + sealed_len(payload.len()));
        let recs = records(&wire);
        assert_eq!(recs.len(), 1 + 3, "the header, then 16 KiB + 16 KiB + the rest");
        assert!(recs.iter().all(|(h, _)| h[..3] == [0x17, 0x03, 0x03]), "TLS 1.3 application data records");
        assert!(!wire.windows(64).any(|w| w == &payload[..64]), "not in clear");
        let mut got = Vec::new();
        for (i, (head, body)) in recs.iter().enumerate() {
            let n = if i == 0 { 28 } else { (payload.len() - (i - 1) * MAX_PLAINTEXT).min(MAX_PLAINTEXT) };
            let mut body = body.clone();
            assert_eq!(open.open(head, &mut body, n), Ok(n));
            got.extend_from_slice(&body[..n]);
        }
        assert_eq!(&got[..28], &[9u8; 28]);
        assert_eq!(&got[28..], &payload[..]);
        // An empty payload is its header's record alone.
        assert_eq!(records(seal.seal_frame(&[1u8; 28], &[])).len(), 1);
    }

    #[test]
    fn a_record_replayed_reordered_altered_or_of_another_key_is_refused() {
        let ((mut seal, _), _) = pair();
        let wire = seal.seal_frame(&[7u8; 28], &[5u8; 100]).to_vec();
        let recs = records(&wire);
        let fresh = || Opener { inbound: Direction::new(&[1u8; 32], &[3u8; 12], 0).unwrap() };
        let mut o = fresh();
        assert_eq!(o.open(&recs[0].0, &mut recs[0].1.clone(), 28), Ok(28));
        assert_eq!(o.open(&recs[0].0, &mut recs[0].1.clone(), 28), Err(Unsealed::Refused), "replayed");
        assert_eq!(fresh().open(&recs[1].0, &mut recs[1].1.clone(), 100), Err(Unsealed::Refused), "out of order");
        let mut altered = recs[0].1.clone();
        altered[3] ^= 1;
        assert_eq!(fresh().open(&recs[0].0, &mut altered, 28), Err(Unsealed::Refused), "altered");
        assert_eq!(fresh().open(&recs[0].0, &mut recs[0].1.clone(), 27), Err(Unsealed::Refused), "not the length expected");
        let mut other = Opener { inbound: Direction::new(&[2u8; 32], &[3u8; 12], 0).unwrap() };
        assert_eq!(other.open(&recs[0].0, &mut recs[0].1.clone(), 28), Err(Unsealed::Refused), "another key");
    }
}
