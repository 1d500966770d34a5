//! Expert loads over training: from a routing-trace file (the same JSON the trainer's
//! `--routing-trace` reads) or from a seeded generator whose skewed popularity drifts.

use lazarus_plan::rng::SplitMix64;

use crate::error::SimError;

/// Largest skew or drift of the generator: its log-popularities stay finite over any run.
pub const MAX_SKEW: f64 = 1e3;

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
    /// Read a routing trace: `[[loads per expert] per layer]` (one epoch), a list of those, or
    /// a `train --json-log` (one JSON object with `expert_load` per line). An error says what is
    /// wrong and where (line, entry and layer index) but not which file: the caller names it.
    pub fn from_trace_json(text: &str, layers: usize, experts: usize) -> Result<Self, SimError> {
        match lazarus_plan::parse_load_trace(text, layers, experts) {
            Ok(epochs) => Ok(LoadModel::Trace(epochs)),
            Err(lazarus_plan::PlanError::Invalid { reason, .. }) => Err(SimError::LoadTrace { reason }),
            Err(e) => Err(SimError::LoadTrace { reason: e.to_string() }),
        }
    }

    /// Check the model against a model shape: a trace needs at least one entry, each of
    /// `layers` layers of `experts` finite, non-negative loads; the generator's skew and drift
    /// must be finite, ≥ 0 and at most [`MAX_SKEW`].
    pub fn validate(&self, layers: usize, experts: usize) -> Result<(), SimError> {
        match self {
            LoadModel::Skewed { skew, drift, .. } => {
                for (field, v) in [("loads.skew", *skew), ("loads.drift", *drift)] {
                    if !v.is_finite() || !(0.0..=MAX_SKEW).contains(&v) {
                        return Err(SimError::invalid(field, v, format!("must be finite, ≥ 0 and ≤ {MAX_SKEW}")));
                    }
                }
            }
            LoadModel::Trace(epochs) => {
                if epochs.is_empty() {
                    return Err(SimError::LoadTrace { reason: "holds no entries".into() });
                }
                for (k, entry) in epochs.iter().enumerate() {
                    if entry.len() != layers {
                        let reason = format!("entry {k} has {} layers, the model has {layers} MoE layers", entry.len());
                        return Err(SimError::LoadTrace { reason });
                    }
                    for (l, loads) in entry.iter().enumerate() {
                        if loads.len() != experts {
                            let reason = format!("entry {k} layer {l} has {} loads, the model has {experts} experts", loads.len());
                            return Err(SimError::LoadTrace { reason });
                        }
                        if let Some(x) = loads.iter().find(|x| !x.is_finite() || **x < 0.0) {
                            return Err(SimError::LoadTrace { reason: format!("entry {k} layer {l}: load {x} is not finite and ≥ 0") });
                        }
                    }
                }
            }
        }
        Ok(())
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

    #[test]
    fn trace_errors_say_what_and_where() {
        for (text, expect) in [
            ("[[1,2],[3]]", "routing trace: entry 0 layer 1 has 1 loads, the model has 2 experts"),
            ("[[[1,2],[3,4]],[[1,2]]]", "routing trace: entry 1 has 1 layers, the model has 2 MoE layers"),
            ("[[1,2],[3,-4]]", "routing trace: entry 0 layer 1: load -4 is not finite and ≥ 0"),
            ("[]", "routing trace: "),
            ("{\"expert_load\": [[1,2],[3,4]]}\n{\"step\": 3}\n", "routing trace: line 2: no \"expert_load\" field"),
            ("[[1,2],", "routing trace: not valid JSON"),
        ] {
            let e = LoadModel::from_trace_json(text, 2, 2).unwrap_err().to_string();
            assert!(e.starts_with(expect), "{text}: {e}");
        }
    }

    #[test]
    fn load_models_are_checked_against_the_model() {
        LoadModel::default().validate(3, 8).unwrap();
        let m = LoadModel::from_trace_json("[[1,2],[3,4]]", 2, 2).unwrap();
        m.validate(2, 2).unwrap();
        let e = m.validate(2, 3).unwrap_err().to_string();
        assert!(e.contains("entry 0 layer 0 has 2 loads, the model has 3 experts"), "{e}");
        assert!(m.validate(3, 2).unwrap_err().to_string().contains("entry 0 has 2 layers"));
        assert!(LoadModel::Trace(vec![]).validate(2, 2).unwrap_err().to_string().contains("no entries"));
        let nan = LoadModel::Trace(vec![vec![vec![1.0, f64::NAN]]]);
        assert!(nan.validate(1, 2).unwrap_err().to_string().contains("load NaN"));
        for (skew, drift, field) in [(f64::NAN, 0.3, "loads.skew"), (1.0, 1e300, "loads.drift"), (-1.0, 0.3, "loads.skew")] {
            let e = LoadModel::Skewed { seed: 0, skew, drift }.validate(2, 2).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }
}
