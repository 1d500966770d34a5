//! Expert loads over training: from a routing-trace file (the same JSON the trainer's
//! `--routing-trace` reads) or from a seeded generator whose skewed popularity drifts.

use lazarus_plan::rng::SplitMix64;

use crate::error::SimError;

/// Loads per layer per expert for each "epoch" of `rebalance_every` steps.
#[derive(Debug, Clone)]
pub enum LoadModel {
    /// Zipf-like popularity `1 / rank^skew` over a random expert order per layer; every epoch
    /// each expert's log-popularity takes a Gaussian step of `drift`.
    Skewed { seed: u64, skew: f64, drift: f64 },
    /// Epoch k uses entry k mod len: `[[[tokens per expert] per layer] per epoch]`.
    Trace(Vec<Vec<Vec<f64>>>),
}

impl Default for LoadModel {
    fn default() -> Self {
        LoadModel::Skewed { seed: 0, skew: 1.0, drift: 0.3 }
    }
}

impl LoadModel {
    /// Read a routing trace: `[[loads per expert] per layer]` (one epoch) or a list of those.
    pub fn from_trace_json(text: &str, layers: usize, experts: usize) -> Result<Self, SimError> {
        Ok(LoadModel::Trace(lazarus_plan::parse_load_trace(text, layers, experts)?))
    }

    /// Loads of every layer in epoch `epoch` (normalised to sum 1 per layer).
    pub fn at(&self, epoch: u64, layers: usize, experts: usize) -> Vec<Vec<f64>> {
        LoadCursor::new(self.clone(), layers, experts).at(epoch)
    }
}

/// One layer's generator state in the drifting walk: its rng and log-popularity per expert.
type LayerWalk = (SplitMix64, Vec<f64>);

/// Sequential access to a [`LoadModel`]: the drifting generator is a random walk, so moving
/// forward one epoch costs one step of it rather than a replay from epoch 0.
#[derive(Debug, Clone)]
pub struct LoadCursor {
    model: LoadModel,
    layers: usize,
    experts: usize,
    /// (epoch, per-layer rng and log-popularity) of the walk.
    walk: Option<(u64, Vec<LayerWalk>)>,
    /// The last few epochs served.
    cache: Vec<(u64, Vec<Vec<f64>>)>,
}

impl LoadCursor {
    pub fn new(model: LoadModel, layers: usize, experts: usize) -> Self {
        LoadCursor { model, layers, experts, walk: None, cache: Vec::new() }
    }

    pub fn at(&mut self, epoch: u64) -> Vec<Vec<f64>> {
        if let Some((_, v)) = self.cache.iter().find(|(e, _)| *e == epoch) {
            return v.clone();
        }
        let loads = match &self.model {
            LoadModel::Trace(epochs) => epochs[(epoch % epochs.len() as u64) as usize].iter().map(|l| normalise(l)).collect(),
            LoadModel::Skewed { seed, skew, drift } => {
                let (seed, skew, drift) = (*seed, *skew, *drift);
                if self.walk.as_ref().is_none_or(|(e, _)| *e > epoch) {
                    let start = (0..self.layers)
                        .map(|l| {
                            let mut rng = SplitMix64::new(seed ^ (l as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                            let mut order: Vec<usize> = (0..self.experts).collect();
                            for i in (1..self.experts).rev() {
                                order.swap(i, rng.below(i + 1));
                            }
                            let logp = (0..self.experts).map(|e| -skew * ((order[e] + 1) as f64).ln()).collect();
                            (rng, logp)
                        })
                        .collect();
                    self.walk = Some((0, start));
                }
                let (at, state) = self.walk.as_mut().expect("set above");
                while *at < epoch {
                    for (rng, logp) in state.iter_mut() {
                        logp.iter_mut().for_each(|x| *x += drift * rng.normal());
                    }
                    *at += 1;
                }
                state
                    .iter()
                    .map(|(_, logp)| {
                        let max = logp.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        normalise(&logp.iter().map(|x| (x - max).exp()).collect::<Vec<_>>())
                    })
                    .collect()
            }
        };
        if self.cache.len() >= 4 {
            self.cache.remove(0);
        }
        self.cache.push((epoch, loads));
        self.cache.last().expect("pushed").1.clone()
    }
}

fn normalise(v: &[f64]) -> Vec<f64> {
    let s: f64 = v.iter().sum();
    if s > 0.0 {
        v.iter().map(|x| x / s).collect()
    } else {
        vec![1.0 / v.len().max(1) as f64; v.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skewed_loads_are_normalised_skewed_and_drift() {
        let m = LoadModel::default();
        let a = m.at(0, 3, 8);
        let b = m.at(5, 3, 8);
        for l in &a {
            assert!((l.iter().sum::<f64>() - 1.0).abs() < 1e-12);
            let max = l.iter().cloned().fold(0.0, f64::max);
            assert!(max > 2.0 / 8.0, "skewed: {l:?}");
        }
        assert_ne!(a, b, "popularity drifts");
        assert_eq!(a, m.at(0, 3, 8), "deterministic");
        // The cursor walks forward and back to the same values.
        let mut c = LoadCursor::new(m.clone(), 3, 8);
        assert_eq!(c.at(5), b);
        assert_eq!(c.at(0), a);
        assert_eq!(c.at(7), m.at(7, 3, 8));
    }

    #[test]
    fn trace_files_are_checked() {
        assert!(LoadModel::from_trace_json("[[1,2],[3,4]]", 2, 2).is_ok());
        let e = LoadModel::from_trace_json("[[1,2]]", 2, 2).unwrap_err().to_string();
        assert!(e.contains("1 layers"), "{e}");
        let e = LoadModel::from_trace_json("[[1,-2],[3,4]]", 2, 2).unwrap_err().to_string();
        assert!(e.contains("-2"), "{e}");
    }
}
