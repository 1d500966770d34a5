//! Router decisions that are not differentiable: top-k selection and trace-driven assignment.

use crate::error::{ModelError, Result};
use candle_core::Tensor;

/// How a router scores the experts and picks a token's k of them: the one home of these rules,
/// read by the single-process layer and the distributed one alike.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Router {
    /// Softmax over the experts, or a sigmoid each (DeepSeek-V3).
    pub score: crate::config::RouterScore,
    /// Whether a token's k > 1 weights are renormalised to sum to 1.
    pub normalize: bool,
    /// The routed weights times this (DeepSeek-V3's routed scaling factor).
    pub scale: f64,
    /// Group-limited routing: `groups` equal groups of experts, the top-k taken among the
    /// `top_groups` best (1, 1: no limit).
    pub groups: usize,
    pub top_groups: usize,
}

impl Default for Router {
    fn default() -> Self {
        Router { score: crate::config::RouterScore::Softmax, normalize: true, scale: 1.0, groups: 1, top_groups: 1 }
    }
}

impl Router {
    /// The router's scores [n, E] from its logits, in their graph, and the probabilities the
    /// load-balancing loss reads: the softmax both times; for a sigmoid router each token's
    /// scores over their sum (DeepSeek-V3's balance loss).
    pub fn scores(&self, logits: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        match self.score {
            crate::config::RouterScore::Softmax => {
                let p = crate::ops::softmax_last(logits)?;
                Ok((p.clone(), p))
            }
            crate::config::RouterScore::Sigmoid => {
                let s = crate::ops::sigmoid(logits)?;
                let p = s.broadcast_div(&s.sum_keepdim(1)?)?;
                Ok((s, p))
            }
        }
    }

    /// Each token's k experts from its scores (host, token-major, `width` a row) plus the
    /// loss-free balancing's bias when there is one (the bias picks the experts, the weights
    /// stay the router's, [`combine_weights`]), within its best groups when routing is
    /// group-limited (a group's score: its two best experts', DeepSeek-V3); n·k ids.
    pub fn choose(&self, scores: &[f64], width: usize, k: usize, bias: Option<&[f64]>) -> Vec<usize> {
        let biased: std::borrow::Cow<'_, [f64]> = match bias {
            Some(b) if b.len() == width && b.iter().any(|&x| x != 0.0) => {
                scores.chunks(width.max(1)).flat_map(|row| row.iter().zip(b).map(|(p, x)| p + x)).collect::<Vec<_>>().into()
            }
            _ => scores.into(),
        };
        if self.groups <= 1 {
            return top_k_rows(&biased, width, k);
        }
        let per = width / self.groups;
        let masked: Vec<f64> = biased
            .chunks(width.max(1))
            .flat_map(|row| {
                let group_score: Vec<f64> = row.chunks(per).map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum()).collect();
                let kept = top_k(&group_score, self.top_groups);
                row.iter().enumerate().map(move |(e, &x)| if kept.contains(&(e / per)) { x } else { f64::NEG_INFINITY }).collect::<Vec<_>>()
            })
            .collect();
        top_k_rows(&masked, width, k)
    }
}

/// The weight of each of a token's k choices [n, k], in the graph of `scores` (the router's
/// scores over all experts, [`Router::scores`]): the chosen scores, divided by their sum when
/// the router normalises and k > 1 (Mixtral, GShard, DeepSeek-V3), as they are otherwise
/// (Qwen-MoE's default, OLMoE; a single softmax choice always, so that the loss reaches the
/// router), times the routed scaling. The single-process layer and the distributed one both
/// weight by it.
pub fn combine_weights(scores: &Tensor, choices: &[u32], n: usize, k: usize, router: &Router) -> candle_core::Result<Tensor> {
    let idx = Tensor::from_vec(choices.to_vec(), (n, k), scores.device())?;
    let w = scores.gather(&idx, 1)?;
    let sigmoid = router.score == crate::config::RouterScore::Sigmoid;
    let w = if router.normalize && (k > 1 || sigmoid) { w.broadcast_div(&w.sum_keepdim(1)?)? } else { w };
    if router.scale != 1.0 {
        return w * router.scale;
    }
    Ok(w)
}

/// Indices of the k largest values (ties to the lower index), largest first.
pub fn top_k(row: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// [`top_k`] of every row of `width` probabilities (row-major): n·k expert ids, token-major. The
/// rows go over the cores (a serial sort per token was ~1 ms a step on the calling thread).
pub fn top_k_rows(probs: &[f64], width: usize, k: usize) -> Vec<usize> {
    use rayon::prelude::*;
    probs.par_chunks(width.max(1)).with_min_len(256).flat_map_iter(|row| top_k(row, k)).collect()
}

/// DeepSeek-V3's bias update after a step (Wang et al. 2024): each expert's bias moves by
/// `rate` toward the mean load, b_e += rate · sign(mean − load_e), from the step's loads over
/// the whole global batch (so every process that saw them moves the same bias the same way).
/// A step with no tokens leaves it as it is.
pub fn update_route_bias(bias: &mut [f64], load: &[u64], rate: f64) {
    let total: u64 = load.iter().sum();
    if total == 0 || bias.len() != load.len() {
        return;
    }
    let mean = total as f64 / load.len() as f64;
    for (b, &l) in bias.iter_mut().zip(load) {
        let l = l as f64;
        if l < mean {
            *b += rate;
        } else if l > mean {
            *b -= rate;
        }
    }
}

/// Trace-driven routing (as in the paper's experiments): assign `n` tokens k experts each so
/// that the number of assignments of each expert follows `loads` (apportioned by largest
/// remainder, at most `n` per expert so no token gets an expert twice). Returns n·k expert ids,
/// token-major.
pub fn assign_from_loads(loads: &[f64], n: usize, k: usize) -> Result<Vec<usize>> {
    let e = loads.len();
    if e < k {
        return Err(ModelError::config("routing trace", format!("{e} experts"), format!("fewer than top_k = {k}")));
    }
    if let Some((i, l)) = loads.iter().enumerate().find(|(_, l)| !l.is_finite() || **l < 0.0) {
        return Err(ModelError::config("routing trace", format!("{l} (expert {i})"), "loads must be finite and ≥ 0"));
    }
    let total: f64 = loads.iter().sum();
    let slots = n * k;
    let weights: Vec<f64> = if total > 0.0 { loads.to_vec() } else { vec![1.0; e] };
    let sum: f64 = weights.iter().sum();
    let mut count: Vec<usize> = weights.iter().map(|w| ((w / sum) * slots as f64).floor() as usize).collect();
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| {
        let ra = (weights[a] / sum) * slots as f64 - count[a] as f64;
        let rb = (weights[b] / sum) * slots as f64 - count[b] as f64;
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    let mut left = slots - count.iter().sum::<usize>();
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        count[i] += 1;
        left -= 1;
    }
    // Cap at n per expert; move the excess to experts with room, most loaded first.
    let mut excess: usize = count.iter().map(|&c| c.saturating_sub(n)).sum();
    count.iter_mut().for_each(|c| *c = (*c).min(n));
    for &i in &order {
        let room = n - count[i];
        let take = room.min(excess);
        count[i] += take;
        excess -= take;
    }
    // Slots sorted by expert; token t takes slots t, t+n, …: distinct experts since each expert
    // has at most n consecutive slots.
    let list: Vec<usize> = (0..e).flat_map(|i| std::iter::repeat_n(i, count[i])).collect();
    Ok((0..n).flat_map(|t| (0..k).map(move |j| t + j * n)).map(|s| list[s]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rows_top_k_over_the_cores_is_each_rows_in_row_order() {
        let width = 8;
        let mut r = crate::rng::SplitMix64::new(3);
        let probs: Vec<f64> = (0..5000 * width).map(|i| if i % 7 == 0 { 0.5 } else { r.uniform() }).collect(); // ties too
        let serial: Vec<usize> = probs.chunks(width).flat_map(|row| top_k(row, 2)).collect();
        assert_eq!(top_k_rows(&probs, width, 2), serial);
        assert!(top_k_rows(&[], width, 2).is_empty());
    }

    #[test]
    fn top_k_picks_distinct_largest() {
        assert_eq!(top_k(&[0.1, 0.5, 0.2, 0.5], 2), vec![1, 3]);
        assert_eq!(top_k(&[0.9, 0.05, 0.05], 1), vec![0]);
    }

    #[test]
    fn forced_assignment_follows_loads_with_distinct_experts() {
        let a = assign_from_loads(&[1.0, 1.0, 2.0, 4.0], 16, 2).unwrap();
        assert_eq!(a.len(), 32);
        let mut count = [0; 4];
        a.iter().for_each(|&e| count[e] += 1);
        assert_eq!(count, [4, 4, 8, 16]);
        for t in 0..16 {
            assert_ne!(a[2 * t], a[2 * t + 1]);
        }
        // An expert wanting more than one slot per token is capped at n.
        let a = assign_from_loads(&[0.0, 0.0, 100.0], 10, 2).unwrap();
        for t in 0..10 {
            assert_ne!(a[2 * t], a[2 * t + 1]);
        }
        assert!(assign_from_loads(&[1.0, f64::NAN], 4, 1).is_err());
        assert!(assign_from_loads(&[1.0], 4, 2).is_err());
    }
}

#[cfg(test)]
mod bias_tests {
    use super::*;

    #[test]
    fn the_bias_moves_toward_the_mean_and_only_picks() {
        let mut bias = vec![0.0; 4];
        // Mean 3: expert 0 over, 1 and 2 under, 3 at the mean.
        update_route_bias(&mut bias, &[6, 2, 1, 3], 0.5);
        assert_eq!(bias, vec![-0.5, 0.5, 0.5, 0.0]);
        update_route_bias(&mut bias, &[0, 0, 0, 0], 0.5);
        assert_eq!(bias, vec![-0.5, 0.5, 0.5, 0.0], "a step without tokens changes nothing");
        // Two tokens over four experts: the bias turns token 0's choice from expert 0 to 1, token
        // 1's from 3 to 2.
        let probs = [0.4, 0.3, 0.2, 0.1, 0.1, 0.2, 0.3, 0.4];
        let router = Router::default();
        assert_eq!(router.choose(&probs, 4, 1, None), vec![0, 3]);
        assert_eq!(router.choose(&probs, 4, 1, Some(&bias)), vec![1, 2]);
        assert_eq!(router.choose(&probs, 4, 2, Some(&[0.0; 4])), top_k_rows(&probs, 4, 2));
    }
}

#[cfg(test)]
mod router_tests {
    use super::*;
    use crate::config::RouterScore;
    use proptest::prelude::*;

    proptest! {
        /// Group-limited choice against its definition: the groups ranked by the sum of their
        /// two best (biased) scores, the best `top_groups` kept, the top-k of their experts.
        #[test]
        fn group_limited_choice_takes_the_best_experts_of_the_best_groups(
            groups in 1usize..5, per in 2usize..5, seed in any::<u64>(), top in 1usize..5, k in 1usize..5,
        ) {
            let top_groups = top.min(groups);
            let width = groups * per;
            let k = k.min(top_groups * per);
            let mut rng = crate::rng::SplitMix64::new(seed);
            let rows = 3;
            let scores: Vec<f64> = (0..rows * width).map(|_| rng.below(1000) as f64 / 1000.0).collect();
            let bias: Vec<f64> = (0..width).map(|_| rng.below(100) as f64 / 1000.0 - 0.05).collect();
            let router = Router { score: RouterScore::Sigmoid, normalize: true, scale: 1.0, groups, top_groups };
            let chosen = router.choose(&scores, width, k, Some(&bias));
            for t in 0..rows {
                let row: Vec<f64> = (0..width).map(|e| scores[t * width + e] + bias[e]).collect();
                let mut group_score: Vec<(f64, usize)> = (0..groups)
                    .map(|g| {
                        let mut v: Vec<f64> = row[g * per..(g + 1) * per].to_vec();
                        v.sort_by(|a, b| b.total_cmp(a));
                        (v[0] + v[1], g)
                    })
                    .collect();
                group_score.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let kept: Vec<usize> = group_score[..top_groups].iter().map(|x| x.1).collect();
                let mut experts: Vec<usize> = (0..width).filter(|e| kept.contains(&(e / per))).collect();
                experts.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                prop_assert_eq!(&chosen[t * k..(t + 1) * k], &experts[..k]);
            }
        }
    }

    /// A sigmoid router's weights: the chosen scores over their sum, times the scaling; its
    /// balance probabilities sum to one per token.
    #[test]
    fn a_sigmoid_routers_weights_are_its_chosen_scores_renormalised_and_scaled() {
        let router = Router { score: RouterScore::Sigmoid, normalize: true, scale: 2.5, groups: 1, top_groups: 1 };
        let logits = Tensor::new(&[[0.0f64, 1.0, -1.0, 2.0]], &candle_core::Device::Cpu).unwrap();
        let (s, p) = router.scores(&logits).unwrap();
        let s: Vec<f64> = s.flatten_all().unwrap().to_vec1().unwrap();
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        for (got, x) in s.iter().zip([0.0, 1.0, -1.0, 2.0]) {
            assert!((got - sig(x)).abs() < 1e-12);
        }
        let p: Vec<f64> = p.flatten_all().unwrap().to_vec1().unwrap();
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let scores = Tensor::from_vec(s.clone(), (1, 4), &candle_core::Device::Cpu).unwrap();
        let w: Vec<f64> = combine_weights(&scores, &[3, 1], 1, 2, &router).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let sum = sig(2.0) + sig(1.0);
        assert!((w[0] - 2.5 * sig(2.0) / sum).abs() < 1e-12 && (w[1] - 2.5 * sig(1.0) / sum).abs() < 1e-12, "{w:?}");
    }
}
