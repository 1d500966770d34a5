//! A fast hash for maps keyed by small integers inside one planning call.
//!
//! Why: choosing the senders of a move at a thousand GPUs looks up tens of thousands of
//! (layer, expert, node) keys; the standard library's SipHash, made to resist keys chosen by an
//! attacker, was a third of that time. The keys here are the plan's own indices and the ids of
//! admitted nodes, and a map lives for one call: the multiply-rotate hash of rustc (FxHash) is
//! enough, and a map's iteration order is never used.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// FxHash: each word rotated into the state and multiplied by a fixed odd constant.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Fx(u64);

impl Fx {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.add(x);
    }

    fn write_usize(&mut self, x: usize) {
        self.add(x as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map hashed with [`Fx`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<Fx>>;

#[cfg(test)]
mod tests {
    use super::FastMap;

    #[test]
    fn a_fast_map_finds_what_it_holds() {
        let mut m: FastMap<(usize, usize, u64), u64> = FastMap::default();
        for i in 0..1000usize {
            m.insert((i % 7, i, i as u64 * 3), i as u64);
        }
        assert_eq!(m.len(), 1000);
        assert!((0..1000usize).all(|i| m.get(&(i % 7, i, i as u64 * 3)) == Some(&(i as u64))));
        assert_eq!(m.get(&(0, 1, 3)), None);
    }
}
