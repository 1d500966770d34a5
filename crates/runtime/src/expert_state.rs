//! One expert's full training state — its weights (W1, b1, W2, b2, or W1 and W2 in a model
//! without FFN biases) and each tensor's AdamW m, v and step count — and its one wire form. The checkpoint gather sends it to rank 0; state transfers
//! after a reconfiguration and snapshots send the same bytes.
//!
//! Wire form (little-endian): magic `LZX1` (u32), MoE layer (u32), expert (u32), then the
//! tensor table and values every training state's wire form ends with (`tensor_wire`). A
//! decoder is told the shapes it expects and checks every size before it allocates, so a peer
//! cannot make it allocate more than one expert.

use crate::error::RuntimeError;
use crate::tensor_wire::{put_table, put_values, shapes_of, tensors_len, Reader, TensorTrainState};

const MAGIC: u32 = 0x4c5a_5831; // "LZX1"
/// The most tensors an expert has: W1 [d, f₁], b1 [f₁], W2 [f, d], b2 [d]
/// ([`lazarus_model::ModelConfig::expert_shapes`]).
pub const EXPERT_TENSORS: usize = 4;

/// Everything needed to train expert `expert` of MoE layer `layer` on another rank as if it had
/// always been there.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertState {
    pub layer: usize,
    pub expert: usize,
    /// In [`lazarus_model::MoeModel::expert_param_names`] order.
    pub tensors: Vec<TensorTrainState>,
}

fn bad(reason: String) -> RuntimeError {
    RuntimeError::Invalid { field: "expert state", reason }
}

impl ExpertState {
    /// Bytes of the wire form of an expert with these tensor shapes.
    pub fn encoded_len(shapes: &[Vec<usize>]) -> usize {
        12 + tensors_len(shapes)
    }

    pub fn encode(&self) -> Vec<u8> {
        let steps: Vec<u64> = self.tensors.iter().map(|t| t.step).collect();
        let mut out = Self::wire_header(self.layer, self.expert, &shapes_of(&self.tensors), &steps);
        for t in &self.tensors {
            for part in [&t.weight, &t.m, &t.v] {
                put_values(&mut out, part);
            }
        }
        out
    }

    /// The start of an expert's wire form — everything before the values — in a buffer with
    /// room for the whole of it. The values follow with [`put_values`]: per tensor its weight,
    /// m and v. What [`Self::encode`] writes from an [`ExpertState`], a worker writes straight
    /// from its tensors (a snapshot every step: one copy instead of two).
    pub fn wire_header(layer: usize, expert: usize, shapes: &[Vec<usize>], steps: &[u64]) -> Vec<u8> {
        Self::wire_header_in(Vec::new(), layer, expert, shapes, steps)
    }

    /// [`Self::wire_header`] written into `out` (emptied first; it keeps its allocation): a
    /// snapshot every step reuses the buffers of the last one's frames.
    pub fn wire_header_in(mut out: Vec<u8>, layer: usize, expert: usize, shapes: &[Vec<usize>], steps: &[u64]) -> Vec<u8> {
        out.clear();
        out.reserve_exact(Self::encoded_len(shapes));
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&(layer as u32).to_le_bytes());
        out.extend_from_slice(&(expert as u32).to_le_bytes());
        put_table(&mut out, shapes.iter().map(|s| s.as_slice()).zip(steps.iter().copied()));
        out
    }

    /// Decode the state of expert (`layer`, `expert`) whose tensors must have `shapes`.
    pub fn decode(bytes: &[u8], layer: usize, expert: usize, shapes: &[Vec<usize>]) -> Result<Self, RuntimeError> {
        let (steps, at) = Self::check(bytes, layer, expert, shapes)?;
        let tensors = Reader::new(bytes, at).tensors(shapes, &steps);
        Ok(ExpertState { layer, expert, tensors })
    }

    /// Check that `bytes` are the wire form of expert (`layer`, `expert`) with `shapes` — length,
    /// magic, layer, expert, every rank and dimension — without copying the values (a snapshot
    /// kept in memory is checked on arrival and decoded only if it is ever restored). Returns each
    /// tensor's AdamW step and where the values begin.
    pub fn check(bytes: &[u8], layer: usize, expert: usize, shapes: &[Vec<usize>]) -> Result<(Vec<u64>, usize), RuntimeError> {
        let bad_here = |reason: String| bad(format!("layer {layer} expert {expert}: {reason}"));
        let mut r = Reader::checked(bytes, Self::encoded_len(shapes), MAGIC, bad_here)?;
        let (l, e) = (r.u32(), r.u32());
        if (l as usize, e as usize) != (layer, expert) {
            return Err(bad(format!("carries layer {l} expert {e}, expected layer {layer} expert {expert}")));
        }
        let steps = r.table(shapes, bad)?;
        Ok((steps, r.at()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_wire::testing::{counting, damaged_never_panic};

    fn sample() -> ExpertState {
        let tensors = counting(&[vec![3, 2], vec![2], vec![2, 3], vec![3]], 0.25, 7);
        ExpertState { layer: 2, expert: 5, tensors }
    }

    #[test]
    fn round_trips_and_checks_what_it_reads() {
        let s = sample();
        let shapes = shapes_of(&s.tensors);
        let bytes = s.encode();
        assert_eq!(bytes.len(), ExpertState::encoded_len(&shapes));
        assert_eq!(ExpertState::decode(&bytes, 2, 5, &shapes).unwrap(), s);
        let e = ExpertState::decode(&bytes, 2, 6, &shapes).unwrap_err().to_string();
        assert!(e.contains("layer 2 expert 5"), "{e}");
        let e = ExpertState::decode(&bytes[..bytes.len() - 4], 2, 5, &shapes).unwrap_err().to_string();
        assert!(e.contains("expected"), "{e}");
        let mut other = shapes.clone();
        other[0] = vec![2, 3];
        let e = ExpertState::decode(&bytes, 2, 5, &other).unwrap_err().to_string();
        assert!(e.contains("tensor 0 dimension 0 is 3, expected 2"), "{e}");
        let mut corrupt = bytes.clone();
        corrupt[0] ^= 1;
        assert!(ExpertState::decode(&corrupt, 2, 5, &shapes).unwrap_err().to_string().contains("magic"));
    }

    #[test]
    fn damaged_bytes_are_an_error_never_a_panic() {
        let s = sample();
        let shapes = shapes_of(&s.tensors);
        damaged_never_panic(&s.encode(), |b| drop(ExpertState::decode(b, 2, 5, &shapes)));
    }
}
