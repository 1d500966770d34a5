//! The training windows: a stream of tokens (in memory, or read a window at a time from an
//! indexed dataset) cut into windows handed out in a seeded order whose cursor resumes exactly.

use serde::{Deserialize, Serialize};

use super::indexed::IndexedFile;
use crate::error::{ModelError, Result};
use crate::rng::SplitMix64;

/// The tokens a sampler cuts into windows.
#[derive(Debug)]
pub enum TokenStream {
    /// All of them, loaded.
    Memory(Vec<u32>),
    /// Indexed datasets one after another, read a window at a time and checked below `vocab`
    /// as they are read; `starts[i]` is where file i begins in the stream.
    Indexed { files: Vec<IndexedFile>, starts: Vec<u64>, vocab: usize },
}

impl From<Vec<u32>> for TokenStream {
    fn from(tokens: Vec<u32>) -> Self {
        TokenStream::Memory(tokens)
    }
}

/// Tokens of a streamed dataset whose frequencies stand for the whole (the loss to beat).
pub const ENTROPY_SAMPLE_TOKENS: usize = 1 << 24;

impl TokenStream {
    /// Indexed datasets read one after another (each already opened and checked).
    pub fn indexed(files: Vec<IndexedFile>, vocab: usize) -> Self {
        let mut starts = Vec::with_capacity(files.len());
        let mut at = 0u64;
        for f in &files {
            starts.push(at);
            at += f.tokens();
        }
        TokenStream::Indexed { files, starts, vocab }
    }

    pub fn len(&self) -> u64 {
        match self {
            TokenStream::Memory(t) => t.len() as u64,
            TokenStream::Indexed { files, starts, .. } => starts.last().zip(files.last()).map_or(0, |(s, f)| s + f.tokens()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens `start .. start + out.len()` into `out`, across files where the window spans two.
    pub fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        if start.checked_add(out.len() as u64).is_none_or(|end| end > self.len()) {
            return Err(ModelError::config("window", format!("{start}..+{}", out.len()), format!("past the data's {} tokens", self.len())));
        }
        match self {
            TokenStream::Memory(t) => {
                let s = start as usize;
                out.copy_from_slice(&t[s..s + out.len()]);
                Ok(())
            }
            TokenStream::Indexed { files, starts, vocab } => {
                let mut done = 0usize;
                while done < out.len() {
                    let at = start + done as u64;
                    let i = starts.partition_point(|&s| s <= at) - 1;
                    let n = ((files[i].tokens() - (at - starts[i])) as usize).min(out.len() - done);
                    files[i].read(at - starts[i], &mut out[done..done + n], *vocab)?;
                    done += n;
                }
                Ok(())
            }
        }
    }

    /// The first `n` tokens (all of them if fewer).
    fn head(&self, n: usize) -> Result<Vec<u32>> {
        let mut head = vec![0u32; (self.len() as usize).min(n)];
        self.read(0, &mut head)?;
        Ok(head)
    }
}

/// Entropy of the token frequencies (nats) of what a sampler of `parts` draws: of every token
/// of one stream in memory; else of the first [`ENTROPY_SAMPLE_TOKENS`] tokens, taken from the
/// parts by their weights.
pub fn unigram_entropy(parts: &[(TokenStream, f64)]) -> Result<f64> {
    if let [(TokenStream::Memory(t), _)] = parts {
        return Ok(super::unigram_entropy(t));
    }
    let total: f64 = parts.iter().map(|p| p.1).sum();
    let mut sample = Vec::new();
    for (tokens, w) in parts {
        sample.extend(tokens.head((ENTROPY_SAMPLE_TOKENS as f64 * w / total).ceil() as usize)?);
    }
    Ok(super::unigram_entropy(&sample))
}

/// Position in the stream of training windows; saved in checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Cursor {
    /// Windows handed out so far.
    pub windows: u64,
}

/// Cuts the token stream into non-overlapping windows of `seq_len + 1` tokens (inputs and
/// shifted targets) and hands them out in a seeded random order, a fresh permutation each
/// epoch. Within an epoch no window repeats; across a resume from a saved [`Cursor`] nothing is
/// repeated or skipped.
///
/// A blend of several streams ([`Sampler::blend`]) draws each window from one of them by
/// weight, as Megatron's blended datasets do: window k comes from the stream furthest behind its
/// share, `argmax_d w_d·(k + 1) − drawn_d` (ties to the first), and is that stream's next window
/// in its own epochs. The draws are a function of k alone: a resume replays them from the cursor.
pub struct Sampler {
    parts: Vec<Part>,
    seq_len: usize,
    seed: u64,
    cursor: Cursor,
    /// Windows drawn from each part before the cursor.
    drawn: Vec<u64>,
}

/// One stream of a sampler: its tokens, its share (weights summing to 1), its windows an epoch,
/// and the order of the epoch it is in.
struct Part {
    tokens: TokenStream,
    weight: f64,
    per: u64,
    epoch: u64,
    order: Order,
}

/// An epoch's order of windows.
enum Order {
    /// A shuffled list: data in memory (the order its runs have always had).
    Listed(Vec<u32>),
    /// A keyed permutation worked out a window at a time: streamed data, where a list would grow
    /// with the file.
    Keyed(Permutation),
}

/// A pseudo-random permutation of 0..n, one element at a time: a four-round Feistel network on
/// the fewest even number of bits that hold n, its outputs past n walked on through the same
/// network until they fall below n (a walk from x < n stays on x's cycle, which comes back
/// below n at x at the latest, so this is a bijection of 0..n; on average fewer than four
/// steps, the network's domain being under 4n).
struct Permutation {
    n: u64,
    half: u32,
    key: u64,
}

impl Permutation {
    fn new(n: u64, key: u64) -> Self {
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(2);
        Permutation { n, half: (bits + bits % 2) / 2, key }
    }

    fn at(&self, x: u64) -> u64 {
        let mut y = self.encrypt(x);
        while y >= self.n {
            y = self.encrypt(y);
        }
        y
    }

    fn encrypt(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half) - 1;
        let (mut left, mut right) = (x >> self.half, x & mask);
        for round in 0..4u64 {
            let f = SplitMix64::new(self.key ^ right.wrapping_mul(0xA24B_AED4_963E_E407) ^ round.wrapping_mul(0x9FB2_1C65_1E98_DF25))
                .next_u64();
            (left, right) = (right, left ^ (f & mask));
        }
        (left << self.half) | right
    }
}

/// One batch: `inputs` and `targets` are [batch × seq_len] row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub batch: usize,
    pub seq_len: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    /// Index of each window in the stream (for tests and logs).
    pub windows: Vec<u64>,
}

impl Sampler {
    pub fn new(tokens: impl Into<TokenStream>, seq_len: usize, seed: u64, cursor: Cursor) -> Result<Self> {
        Sampler::blend(vec![(tokens.into(), 1.0)], seq_len, seed, cursor)
    }

    /// Windows drawn from `parts` by their weights (any positive numbers: shares of their sum).
    pub fn blend(parts: Vec<(TokenStream, f64)>, seq_len: usize, seed: u64, cursor: Cursor) -> Result<Self> {
        if seq_len == 0 {
            return Err(ModelError::config("seq_len", 0, "must be at least 1"));
        }
        if parts.is_empty() {
            return Err(ModelError::config("data", "[]", "no token stream to sample"));
        }
        if let Some((d, w)) = parts.iter().map(|p| p.1).enumerate().find(|(_, w)| !w.is_finite() || *w <= 0.0) {
            return Err(ModelError::config("data weights", w, format!("weight {} must be finite and > 0", d + 1)));
        }
        let total: f64 = parts.iter().map(|p| p.1).sum();
        let named = |d: usize| if parts.len() > 1 { format!("the data's part {}", d + 1) } else { "the data".into() };
        for (d, (tokens, _)) in parts.iter().enumerate() {
            if tokens.len() < seq_len as u64 + 1 {
                return Err(ModelError::config(
                    "seq_len",
                    seq_len,
                    format!("{} has only {} tokens; need at least seq_len + 1", named(d), tokens.len()),
                ));
            }
            // An epoch's order in memory is a list of u32 window numbers.
            if matches!(tokens, TokenStream::Memory(_)) && (tokens.len() - 1) / seq_len as u64 > u32::MAX as u64 {
                return Err(ModelError::config(
                    "seq_len",
                    seq_len,
                    format!("{} tokens make more than 2^32 windows of it: train on part of the data, or longer windows", tokens.len()),
                ));
            }
        }
        let parts: Vec<Part> = parts
            .into_iter()
            .map(|(tokens, w)| Part {
                per: (tokens.len() - 1) / seq_len as u64,
                tokens,
                weight: w / total,
                epoch: u64::MAX,
                order: Order::Listed(Vec::new()),
            })
            .collect();
        let mut s = Sampler { drawn: vec![0; parts.len()], parts, seq_len, seed, cursor: Cursor::default() };
        s.seek(cursor);
        Ok(s)
    }

    /// Windows per epoch (of all the parts together).
    pub fn windows_per_epoch(&self) -> u64 {
        self.parts.iter().map(|p| p.per).sum()
    }

    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// The part window `k` comes from, `drawn` being what each part gave before it.
    fn choose(&self, k: u64, drawn: &[u64]) -> usize {
        if self.parts.len() == 1 {
            return 0;
        }
        let behind = |d: usize| self.parts[d].weight * (k + 1) as f64 - drawn[d] as f64;
        (1..self.parts.len()).fold(0, |best, d| if behind(d) > behind(best) { d } else { best })
    }

    /// Draw windows `from .. to` into `drawn`.
    fn draw(&self, from: u64, to: u64, drawn: &mut [u64]) {
        if self.parts.len() == 1 {
            drawn[0] += to - from;
            return;
        }
        for k in from..to {
            drawn[self.choose(k, drawn)] += 1;
        }
    }

    /// The next `batch` windows, and the cursor moves past them.
    pub fn next_batch(&mut self, batch: usize) -> Result<Batch> {
        let out = self.peek_batch(batch)?;
        self.advance(batch);
        Ok(out)
    }

    /// The next `batch` windows without moving the cursor: a distributed step reads its batch
    /// here and moves the cursor only when it commits ([`Sampler::advance`]), so an abandoned
    /// step leaves the data position untouched and its re-run reads the same batch. (Only the
    /// cached permutations of the epochs may change, and they are a function of the cursor.)
    /// A streamed dataset's read that fails (or a token outside the vocabulary) is an error
    /// naming the file and where.
    pub fn peek_batch(&mut self, batch: usize) -> Result<Batch> {
        let mut out = Batch {
            batch,
            seq_len: self.seq_len,
            inputs: Vec::with_capacity(batch * self.seq_len),
            targets: Vec::with_capacity(batch * self.seq_len),
            windows: Vec::with_capacity(batch),
        };
        let mut drawn = self.drawn.clone();
        let mut window = vec![0u32; self.seq_len + 1];
        for k in 0..batch as u64 {
            let index = self.cursor.windows + k;
            let d = self.choose(index, &drawn);
            let j = drawn[d];
            drawn[d] += 1;
            let key = self.seed ^ (d as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            let part = &mut self.parts[d];
            part.prepare_epoch(j / part.per, key);
            let w = part.window_at(j % part.per);
            part.tokens.read(w * self.seq_len as u64, &mut window)?;
            out.inputs.extend_from_slice(&window[..self.seq_len]);
            out.targets.extend_from_slice(&window[1..]);
            out.windows.push(index);
        }
        Ok(out)
    }

    /// Put the cursor at `cursor` (a worker that joins a running job takes its peers'): a
    /// blend's draws before it are replayed (a few operations a window).
    pub fn seek(&mut self, cursor: Cursor) {
        let mut drawn = vec![0; self.parts.len()];
        self.draw(0, cursor.windows, &mut drawn);
        self.drawn = drawn;
        self.cursor = cursor;
    }

    /// Move the cursor past `batch` windows (a committed step).
    pub fn advance(&mut self, batch: usize) {
        let mut drawn = std::mem::take(&mut self.drawn);
        self.draw(self.cursor.windows, self.cursor.windows + batch as u64, &mut drawn);
        self.drawn = drawn;
        self.cursor.windows += batch as u64;
    }
}

impl Part {
    /// Make `order` the permutation of epoch `epoch` (`key`: the sampler's seed for this part).
    fn prepare_epoch(&mut self, epoch: u64, key: u64) {
        if epoch == self.epoch {
            return;
        }
        let key = key ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.order = match self.tokens {
            TokenStream::Memory(_) => {
                let mut rng = SplitMix64::new(key);
                let mut order: Vec<u32> = (0..self.per as u32).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i + 1));
                }
                Order::Listed(order)
            }
            TokenStream::Indexed { .. } => Order::Keyed(Permutation::new(self.per, key)),
        };
        self.epoch = epoch;
    }

    /// The window at place `i` of the current epoch's order.
    fn window_at(&self, i: u64) -> u64 {
        match &self.order {
            Order::Listed(order) => order[i as usize] as u64,
            Order::Keyed(p) => p.at(i),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::indexed::{write_indexed, TokenType};
    use crate::data::DataSource;

    #[test]
    fn a_peeked_batch_moves_nothing_until_advanced() {
        let tokens: Vec<u32> = (0..1000).map(|i| i % 256).collect();
        let mut plain = Sampler::new(tokens.clone(), 10, 7, Cursor::default()).unwrap();
        let mut peeking = Sampler::new(tokens, 10, 7, Cursor::default()).unwrap();
        // 13 batches of 7 windows cross the 99-window epochs, one batch straddling a boundary.
        for _ in 0..30 {
            let before = peeking.cursor();
            let a = peeking.peek_batch(7).unwrap();
            assert_eq!(peeking.cursor(), before, "a peek moves no cursor");
            assert_eq!(peeking.peek_batch(7).unwrap(), a, "a re-run reads the same batch");
            peeking.advance(7);
            assert_eq!(plain.next_batch(7).unwrap(), a);
            assert_eq!(peeking.cursor(), plain.cursor());
        }
    }

    #[test]
    fn sampler_never_repeats_or_skips_across_a_resume() {
        let tokens: Vec<u32> = (0..1000).map(|i| i % 256).collect();
        let mut whole = Sampler::new(tokens.clone(), 10, 7, Cursor::default()).unwrap();
        let per = whole.windows_per_epoch();
        let uninterrupted: Vec<Batch> = (0..40).map(|_| whole.next_batch(6).unwrap()).collect();

        let mut first = Sampler::new(tokens.clone(), 10, 7, Cursor::default()).unwrap();
        let mut resumed_run: Vec<Batch> = (0..17).map(|_| first.next_batch(6).unwrap()).collect();
        let saved = first.cursor();
        let mut second = Sampler::new(tokens, 10, 7, saved).unwrap();
        resumed_run.extend((17..40).map(|_| second.next_batch(6).unwrap()));
        assert_eq!(uninterrupted, resumed_run);

        // Within each epoch every window appears exactly once.
        let starts: Vec<u32> = uninterrupted.iter().flat_map(|b| b.inputs.chunks(10).map(|c| c[0])).collect();
        for epoch in starts.chunks(per as usize).filter(|c| c.len() == per as usize) {
            let mut e = epoch.to_vec();
            e.sort();
            e.dedup();
            assert_eq!(e.len(), per as usize);
        }
        // Targets are inputs shifted by one.
        let b = &uninterrupted[3];
        assert_eq!(&b.inputs[1..10], &b.targets[..9]);
    }

    #[test]
    fn a_blend_draws_by_weight_each_part_in_its_own_epochs_and_resumes() {
        // Part 0: tokens 0..; part 1: tokens 10,000.. (every window says where it came from).
        let a: Vec<u32> = (0..401).collect();
        let b: Vec<u32> = (10_000..10_201).collect();
        let parts = || vec![(TokenStream::from(a.clone()), 3.0), (TokenStream::from(b.clone()), 1.0)];
        let mut s = Sampler::blend(parts(), 10, 5, Cursor::default()).unwrap();
        assert_eq!(s.windows_per_epoch(), 40 + 20);
        let batches: Vec<Batch> = (0..20).map(|_| s.next_batch(8).unwrap()).collect();
        let firsts: Vec<u32> = batches.iter().flat_map(|b| b.inputs.chunks(10).map(|w| w[0])).collect();
        // Every 4 windows: 3 of part 0, 1 of part 1, exactly.
        for (k, four) in firsts.chunks(4).enumerate() {
            assert_eq!(four.iter().filter(|&&t| t >= 10_000).count(), 1, "windows {}..{}: {four:?}", 4 * k, 4 * k + 4);
        }
        // Each part's windows: each of its epoch once before any repeats (part 0: 120 drawn, 40 an
        // epoch; part 1: 40 drawn, 20 an epoch).
        for (from, per) in [(0u32, 40usize), (10_000, 20)] {
            let mine: Vec<u32> = firsts.iter().copied().filter(|&t| (t >= 10_000) == (from == 10_000)).collect();
            for epoch in mine.chunks(per) {
                let mut e = epoch.to_vec();
                e.sort_unstable();
                e.dedup();
                assert_eq!(e.len(), per, "part from {from}");
            }
        }
        // A resume anywhere goes on with the same windows.
        for at in [0usize, 1, 7, 13] {
            let mut r = Sampler::blend(parts(), 10, 5, Cursor { windows: 8 * at as u64 }).unwrap();
            for b in &batches[at..] {
                assert_eq!(&r.next_batch(8).unwrap(), b, "resumed at batch {at}");
            }
        }
        // One part of weight 1 is the plain sampler.
        let mut one = Sampler::blend(vec![(TokenStream::from(a.clone()), 2.5)], 10, 5, Cursor::default()).unwrap();
        let mut plain = Sampler::new(a.clone(), 10, 5, Cursor::default()).unwrap();
        assert_eq!(one.next_batch(50).unwrap(), plain.next_batch(50).unwrap());
        for w in [0.0, -1.0, f64::NAN] {
            let e = Sampler::blend(vec![(TokenStream::from(a.clone()), 1.0), (TokenStream::from(b.clone()), w)], 10, 5, Cursor::default());
            assert!(e.err().expect("refused").to_string().contains("weight 2"), "{w}");
        }
        let e = Sampler::blend(vec![(TokenStream::from(a.clone()), 1.0), (TokenStream::from(vec![1, 2]), 1.0)], 10, 5, Cursor::default());
        assert!(e.err().expect("refused").to_string().contains("part 2 has only 2 tokens"));
    }

    #[test]
    fn a_keyed_permutation_takes_every_window_once() {
        for n in [1u64, 2, 3, 5, 64, 100, 1000, 4097] {
            for key in [0u64, 7, u64::MAX] {
                let p = Permutation::new(n, key);
                let mut seen: Vec<u64> = (0..n).map(|i| p.at(i)).collect();
                let first = seen.clone();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n}, key {key}");
                if n >= 100 {
                    assert!(first.windows(2).filter(|w| w[1] == w[0] + 1).count() < n as usize / 10, "n {n}: hardly shuffled");
                    assert_ne!(first, (0..n).map(|i| Permutation::new(n, key ^ 1).at(i)).collect::<Vec<_>>(), "another key, another order");
                }
            }
        }
    }

    #[test]
    fn an_indexed_dataset_streams_the_windows_its_tokens_make_in_memory() {
        let dir = std::env::temp_dir().join(format!("lazarus-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tokens: Vec<u32> = (0..1000).map(|i| (i * 7 + i / 13) % 500).collect();
        // Two datasets of uneven documents: windows span documents and the two files.
        let docs = |part: &[u32]| part.chunks(37).map(<[u32]>::to_vec).collect::<Vec<_>>();
        write_indexed(&dir.join("a"), &docs(&tokens[..613]), TokenType::U16).unwrap();
        write_indexed(&dir.join("b"), &docs(&tokens[613..]), TokenType::I32).unwrap();
        let source = DataSource::Megatron { prefixes: vec![dir.join("a"), dir.join("b.idx")], weights: None };
        let bytes = crate::tokenizer::TextTokenizer::Bytes;
        let stream = source.open(500, &bytes).unwrap();
        assert!(matches!(stream, TokenStream::Indexed { .. }));
        assert_eq!(stream.len(), 1000);
        assert_eq!(source.load_with(500, &bytes).unwrap(), tokens, "read whole, the same tokens");
        let mut streamed = Sampler::new(stream, 10, 3, Cursor::default()).unwrap();
        let per = streamed.windows_per_epoch();
        assert_eq!(per, 99);
        // Every window of the tokens once an epoch (read across documents and files), targets
        // the inputs shifted by one.
        let window_of = |row: &[u32]| (0..per as usize).find(|&w| tokens[w * 10..w * 10 + 10] == *row);
        for epoch in 0..2 {
            let b = streamed.next_batch(per as usize).unwrap();
            let mut seen: Vec<usize> =
                b.inputs.chunks(10).map(|row| window_of(row).unwrap_or_else(|| panic!("epoch {epoch}: {row:?} is no window"))).collect();
            for (k, &w) in seen.iter().enumerate() {
                assert_eq!(b.targets[k * 10..k * 10 + 10], tokens[w * 10 + 1..w * 10 + 11]);
            }
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), per as usize, "epoch {epoch}");
        }
        // A resume from the cursor goes on with the same windows.
        let uninterrupted = streamed.next_batch(5).unwrap();
        let mut resumed = Sampler::new(source.open(500, &bytes).unwrap(), 10, 3, Cursor { windows: 2 * per }).unwrap();
        assert_eq!(resumed.next_batch(5).unwrap(), uninterrupted);
        // A token outside the vocabulary is found when its window is read, named by file and place.
        let mut small = Sampler::new(source.open(400, &bytes).unwrap(), 10, 3, Cursor::default()).unwrap();
        let e = (0..20).find_map(|_| small.next_batch(7).err()).expect("some window holds a token of 400 or more").to_string();
        assert!(e.contains("outside the vocabulary of 400") && e.contains(".bin"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
