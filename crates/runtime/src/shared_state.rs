//! The replicated part of a worker's training state — every non-expert tensor with its AdamW
//! m, v and step, the step counter and the data cursor — and its one wire form. A worker that
//! joins a running job (paper §4.3, scale-up) takes it from a peer, then the expert states its
//! placement gives it ([`crate::ExpertState`]), and trains on as if it had always been there.
//!
//! Wire form (little-endian): magic `LZD1` (u32), steps committed (u64), data cursor in windows
//! (u64), tensor count (u32), then the tensor table and values every training state's wire form
//! ends with (`tensor_wire`). A decoder is told the shapes
//! it expects (its own model's) and checks the length before it reads anything, so a peer
//! cannot make it allocate more than one model's replicated state.

use crate::error::RuntimeError;
use crate::tensor_wire::{put_tensors, shapes_of, tensors_len, Reader, TensorTrainState};

const MAGIC: u32 = 0x4c5a_4431; // "LZD1"

/// The replicated training state of a job at a committed step.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedState {
    /// Steps committed.
    pub step: u64,
    /// Windows of data consumed.
    pub cursor: u64,
    /// Every non-expert tensor, in parameter order.
    pub tensors: Vec<TensorTrainState>,
}

fn bad(reason: String) -> RuntimeError {
    RuntimeError::Invalid { field: "shared state", reason }
}

impl SharedState {
    /// Bytes of the wire form for tensors of these shapes.
    pub fn encoded_len(shapes: &[Vec<usize>]) -> usize {
        24 + tensors_len(shapes)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::encoded_len(&shapes_of(&self.tensors)));
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(&self.cursor.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u32).to_le_bytes());
        put_tensors(&mut out, &self.tensors);
        out
    }

    /// Decode a state whose tensors must have `shapes`.
    pub fn decode(bytes: &[u8], shapes: &[Vec<usize>]) -> Result<Self, RuntimeError> {
        let mut r = Reader::checked(bytes, Self::encoded_len(shapes), MAGIC, bad)?;
        let (step, cursor) = (r.u64(), r.u64());
        let count = r.u32() as usize;
        if count != shapes.len() {
            return Err(bad(format!("{count} tensors, expected {}", shapes.len())));
        }
        let steps = r.table(shapes, bad)?;
        let tensors = r.tensors(shapes, &steps);
        Ok(SharedState { step, cursor, tensors })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_wire::testing::{counting, damaged_never_panic};

    fn sample() -> SharedState {
        SharedState { step: 11, cursor: 88, tensors: counting(&[vec![4, 2], vec![2], vec![]], 0.5, 3) }
    }

    #[test]
    fn round_trips_and_checks_what_it_reads() {
        let s = sample();
        let shapes = shapes_of(&s.tensors);
        let bytes = s.encode();
        assert_eq!(bytes.len(), SharedState::encoded_len(&shapes));
        assert_eq!(SharedState::decode(&bytes, &shapes).unwrap(), s);
        let e = SharedState::decode(&bytes[..bytes.len() - 4], &shapes).unwrap_err().to_string();
        assert!(e.contains("expected"), "{e}");
        let mut other = shapes.clone();
        other[0] = vec![2, 4];
        let e = SharedState::decode(&bytes, &other).unwrap_err().to_string();
        assert!(e.contains("tensor 0 dimension 0 is 4, expected 2"), "{e}");
        let mut corrupt = bytes.clone();
        corrupt[0] ^= 1;
        assert!(SharedState::decode(&corrupt, &shapes).unwrap_err().to_string().contains("magic"));
    }

    #[test]
    fn damaged_bytes_are_an_error_never_a_panic() {
        let s = sample();
        let shapes = shapes_of(&s.tensors);
        damaged_never_panic(&s.encode(), |b| drop(SharedState::decode(b, &shapes)));
    }
}
