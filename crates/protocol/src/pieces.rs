//! Long messages to an agent travel in pieces.
//!
//! Why: tonic encodes each stream's messages into a buffer of its own that keeps the capacity of
//! the largest message it ever held. A thousand agents' streams each sent a node's start (1.15
//! MiB compressed) and later a rebalance's order (1.9 MB) kept about 2 GB of the controller's
//! memory for the rest of the job. Sent as pieces of at most [`PIECE_BYTES`] — each a slice of
//! the bytes shared by every agent, nothing copied — a stream's buffer stays that small.
//!
//! The hub sends the leading pieces of a message's long field ([`in_pieces`]) and then the
//! message with the rest, all under one lock, so nothing comes between them on the stream; the
//! agent gathers the pieces and puts them before the field's own bytes ([`Gathered::take`]),
//! with the same bound as a whole message.

use prost::bytes::Bytes;

use crate::proto::{controller_message::Body, ControllerMessage};

/// The most a piece carries.
pub const PIECE_BYTES: usize = 64 << 10;

/// `body` as sent: the leading pieces of its long field (a message to workers or a job past [`PIECE_BYTES`]),
/// then the body with the rest of it (at most one piece).
pub fn in_pieces(body: Body) -> (Vec<Bytes>, Body) {
    match body {
        Body::Input(mut i) if i.message.len() > PIECE_BYTES => {
            let (pieces, rest) = split(&i.message);
            i.message = rest;
            (pieces, Body::Input(i))
        }
        Body::Start(mut s) if s.job.len() > PIECE_BYTES => {
            let (pieces, rest) = split(&s.job);
            s.job = rest;
            (pieces, Body::Start(s))
        }
        other => (Vec::new(), other),
    }
}

/// Slices of `bytes`: every whole piece but the last, and the last (shared, not copied).
fn split(bytes: &Bytes) -> (Vec<Bytes>, Bytes) {
    let last = (bytes.len() - 1) / PIECE_BYTES * PIECE_BYTES;
    let pieces = (0..last).step_by(PIECE_BYTES).map(|at| bytes.slice(at..at + PIECE_BYTES)).collect();
    (pieces, bytes.slice(last..))
}

/// The pieces an agent has been sent of the message to come.
#[derive(Debug, Default)]
pub struct Gathered {
    data: Vec<u8>,
}

impl Gathered {
    /// The message to act on, its long field whole (`None`: a piece, kept). A message of
    /// another kind after pieces, or pieces past `max` bytes, is an error that drops them.
    pub fn take(&mut self, mut m: ControllerMessage, max: usize) -> Result<Option<ControllerMessage>, String> {
        match &mut m.body {
            Some(Body::Piece(p)) => {
                if self.data.len() + p.data.len() > max {
                    let got = self.data.len() + p.data.len();
                    self.data = Vec::new();
                    return Err(format!("pieces of a message past {max} bytes ({got}): dropped"));
                }
                self.data.extend_from_slice(&p.data);
                Ok(None)
            }
            _ if self.data.is_empty() => Ok(Some(m)),
            Some(Body::Input(i)) => {
                i.message = self.joined(&i.message);
                Ok(Some(m))
            }
            Some(Body::Start(s)) => {
                s.job = self.joined(&s.job);
                Ok(Some(m))
            }
            _ => {
                let got = std::mem::take(&mut self.data).len();
                Err(format!("{got} bytes of pieces followed by a message that takes none: dropped"))
            }
        }
    }

    /// The pieces and then `rest`, as one; nothing kept.
    fn joined(&mut self, rest: &[u8]) -> Bytes {
        let mut data = std::mem::take(&mut self.data);
        data.extend_from_slice(rest);
        Bytes::from(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Piece, Ping, StartWorkers, WorkerInput};

    fn message(body: Body) -> ControllerMessage {
        ControllerMessage { job_id: "j".into(), epoch: 3, body: Some(body) }
    }

    /// Lines and jobs of every length about the piece size come back whole, through pieces that
    /// are slices of the one buffer; short ones and other messages go as they are.
    #[test]
    fn a_long_field_goes_in_pieces_and_comes_back_whole() {
        for len in [0, 1, PIECE_BYTES - 1, PIECE_BYTES, PIECE_BYTES + 1, 3 * PIECE_BYTES, 3 * PIECE_BYTES + 17] {
            let bytes = Bytes::from((0..len).map(|i| (i * 31 % 251) as u8).collect::<Vec<_>>());
            for body in [
                Body::Input(WorkerInput { slots: vec![0, 2], message: bytes.clone(), deflated: true }),
                Body::Start(StartWorkers {
                    workers: vec![crate::relay::start::slot_to_proto(0, 1, 0, 1.0, "", false)],
                    job: bytes.clone(),
                    standby: false,
                }),
            ] {
                let (pieces, rest) = in_pieces(body.clone());
                assert_eq!(pieces.len(), len.saturating_sub(1) / PIECE_BYTES, "{len} bytes");
                assert!(pieces.iter().all(|p| p.len() == PIECE_BYTES && bytes.as_ptr_range().contains(&p.as_ptr())), "shared slices");
                let mut gathered = Gathered::default();
                for p in pieces {
                    assert_eq!(gathered.take(message(Body::Piece(Piece { data: p })), usize::MAX), Ok(None));
                }
                assert_eq!(gathered.take(message(rest), usize::MAX), Ok(Some(message(body))), "{len} bytes");
                assert!(gathered.data.is_empty());
            }
        }
        let ping = message(Body::Ping(Ping {}));
        assert_eq!(Gathered::default().take(ping.clone(), 0), Ok(Some(ping)));
    }

    /// Pieces past the bound, or followed by a message that takes none, are refused and dropped:
    /// the next message is taken as it is.
    #[test]
    fn pieces_past_the_bound_or_out_of_place_are_refused() {
        let piece = |n: usize| message(Body::Piece(Piece { data: Bytes::from(vec![7u8; n]) }));
        let mut gathered = Gathered::default();
        assert_eq!(gathered.take(piece(10), 25), Ok(None));
        assert_eq!(gathered.take(piece(10), 25), Ok(None));
        let err = gathered.take(piece(10), 25).unwrap_err();
        assert!(err.contains("past 25 bytes (30)"), "{err}");
        let line = message(Body::Input(WorkerInput { slots: vec![1], message: Bytes::from_static(b"{}"), deflated: false }));
        assert_eq!(gathered.take(line.clone(), 25), Ok(Some(line.clone())), "nothing of the dropped pieces is kept");
        assert_eq!(gathered.take(piece(5), 25), Ok(None));
        let err = gathered.take(message(Body::Ping(Ping {})), 25).unwrap_err();
        assert!(err.contains("5 bytes of pieces followed by a message that takes none"), "{err}");
        assert_eq!(gathered.take(line.clone(), 25), Ok(Some(line)));
    }
}
