//! Decoder with Mixture-of-Experts feed-forwards (paper §2.1, Switch/GShard-style routing), on
//! candle: the paper's GPT-style blocks by default, Mixtral's or DeepSeek-MoE's by the options of
//! [`ModelConfig`] (norm, positions, activation, biases, top-k, shared experts).
//!
//! Every expert's tensors are separate parameters named
//! `blocks.{b}.moe.experts.{e}.{fc1,fc2}.{w,b}` (no `.b` without FFN biases), addressable by
//! (MoE layer, expert) through [`MoeModel::expert_param_names`], so a later stage can move one
//! expert between processes. Shared experts are `blocks.{b}.moe.shared.*`, dense parameters.

use crate::ops::WeightGradSink;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::config::{Activation, ModelConfig, NormKind, Positions};
use crate::error::{ModelError, Result};
use crate::params::{Init, ParamStore};
use crate::routing::assign_from_loads;

mod attention;
mod moe_layer;

use attention::AttentionLayer;

pub use moe_layer::{MoeLayer, MoeStats};

struct Linear {
    w: Var,
    /// None for a layer without a bias.
    b: Option<Var>,
}

impl Linear {
    fn new(ps: &mut ParamStore, init: &mut Init, name: &str, (din, dout): (usize, usize), std: f64, bias: bool) -> Result<Self> {
        let w = ps.add(format!("{name}.w"), init.normal(&[din, dout], std)?)?;
        let b = if bias { Some(ps.add(format!("{name}.b"), init.constant(&[dout], 0.0)?)?) } else { None };
        Ok(Linear { w, b })
    }

    /// x: [N, din] → [N, dout] (fused kernel, see [`crate::ops::linear`]), the product in
    /// `compute` and the result in x's dtype.
    fn forward(&self, x: &Tensor, compute: DType) -> Result<Tensor> {
        let c = |t: &Tensor| t.to_dtype(compute);
        let b = match &self.b {
            Some(b) => c(b.as_tensor())?,
            None => Tensor::zeros(self.w.dim(1)?, compute, self.w.device())?,
        };
        Ok(crate::ops::linear(&c(x)?, &c(self.w.as_tensor())?, &b)?.to_dtype(x.dtype())?)
    }
}

/// LayerNorm (with its bias) or RMSNorm (without one).
struct Norm {
    w: Var,
    /// LayerNorm's bias; None: RMSNorm.
    b: Option<Var>,
    eps: f64,
}

impl Norm {
    fn new(ps: &mut ParamStore, init: &Init, name: &str, d: usize, kind: NormKind, eps: f64) -> Result<Self> {
        let w = ps.add(format!("{name}.w"), init.constant(&[d], 1.0)?)?;
        let b = match kind {
            NormKind::Layer => Some(ps.add(format!("{name}.b"), init.constant(&[d], 0.0)?)?),
            NormKind::Rms => None,
        };
        Ok(Norm { w, b, eps })
    }

    /// LayerNorm or RMSNorm over the last dimension (fused kernels, see [`crate::ops`]).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_to(x, x.dtype())
    }

    /// [`Norm::forward`] into `out` (bf16 for a bf16 product next: one kernel on a GPU).
    fn forward_to(&self, x: &Tensor, out: DType) -> Result<Tensor> {
        Ok(match &self.b {
            Some(b) => crate::ops::layer_norm_to(x, self.w.as_tensor(), b.as_tensor(), self.eps, out)?,
            None => crate::ops::rms_norm_to(x, self.w.as_tensor(), self.eps, out)?,
        })
    }
}

/// Linear–activation–Linear (GELU or SwiGLU). One expert, the shared experts of an MoE block,
/// or the dense FFN of a non-MoE block.
pub struct Ffn {
    fc1: Linear,
    fc2: Linear,
    act: Activation,
}

impl Ffn {
    /// An FFN of hidden width `f` with the config's activation and biases.
    fn new(ps: &mut ParamStore, init: &mut Init, name: &str, cfg: &ModelConfig, f: usize) -> Result<Self> {
        let out_std = cfg.init_std / (2.0 * cfg.n_layers as f64).sqrt();
        let (d, f1) = (cfg.d_model, cfg.expert_act.first_width(f));
        Ok(Ffn {
            fc1: Linear::new(ps, init, &format!("{name}.fc1"), (d, f1), cfg.init_std, cfg.ffn_bias)?,
            fc2: Linear::new(ps, init, &format!("{name}.fc2"), (f, d), out_std, cfg.ffn_bias)?,
            act: cfg.expert_act,
        })
    }

    /// x: [n, d_model] → [n, d_model] (one fused autograd node, see [`crate::ops::expert_ffn`]),
    /// computed in `compute`, the result in x's dtype.
    pub fn forward(&self, x: &Tensor, compute: DType) -> Result<Tensor> {
        let [w1, b1, w2, b2] = self.weights_in(compute)?;
        Ok(crate::ops::expert_ffn(&x.to_dtype(compute)?, &w1, &b1, &w2, &b2, self.act)?.to_dtype(x.dtype())?)
    }

    /// [`Ffn::forward`] on the GPU path: h in the products' type (the norm wrote it), each
    /// product reading its weight's working copy where it has one, the activation our kernel, the
    /// result in `out` (the residual stream's type). No cast node.
    fn forward_gpu(&self, model: &MoeModel, h: &Tensor, out: DType) -> Result<Tensor> {
        let hidden = model.linear(&self.fc1, h, h.dtype())?;
        model.linear(&self.fc2, &crate::ops::cuda_activation(&hidden, self.act)?, out)
    }

    /// The parameters, in [`MoeModel::expert_param_names`] order (no biases when it has none).
    fn vars(&self) -> Vec<Var> {
        [Some(&self.fc1.w), self.fc1.b.as_ref(), Some(&self.fc2.w), self.fc2.b.as_ref()].into_iter().flatten().cloned().collect()
    }

    /// [W1, b1, W2, b2] in `dtype` (the parameters themselves when they already are; zeros for
    /// absent biases).
    fn weights_in(&self, dtype: DType) -> candle_core::Result<[Tensor; 4]> {
        let vars = self.vars();
        let refs: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
        let [w1, b1, w2, b2] = crate::ops::ffn_weights(&refs)?;
        let cast = |t: Tensor| t.to_dtype(dtype);
        Ok([cast(w1)?, cast(b1)?, cast(w2)?, cast(b2)?])
    }
}

enum FeedForward {
    Dense(Ffn),
    Moe(MoeLayer),
}

struct Block {
    ln1: Norm,
    attn: AttentionLayer,
    ln2: Norm,
    ff: FeedForward,
}

/// The result of one forward pass.
pub struct ForwardOutput {
    /// Mean next-token cross-entropy (nats).
    pub ce_loss: Tensor,
    /// Mean over MoE layers of the load-balancing loss.
    pub aux_loss: Tensor,
    /// ce_loss + aux_weight · aux_loss ([`ModelConfig::aux_weight`]): what
    /// [`ForwardOutput::backward`] differentiates.
    pub loss: Tensor,
    /// Per MoE layer.
    pub moe: Vec<MoeStats>,
    /// The next-token logits [B·T, V] the loss was taken of (generation samples from them).
    pub logits: Tensor,
    /// Where the MoE layers' backward puts the expert weights' gradients.
    expert_grads: WeightGradSink,
}

impl ForwardOutput {
    /// The gradient of `loss` for every parameter: candle's backward for all but the expert
    /// weights, whose gradients the grouped expert node hands over directly (no copies into
    /// stacks, no serial zero-fill and add per level; see [`crate::ops::grouped_expert_ffn_to_sink`]).
    /// Call this rather than `loss.backward()`, which leaves the experts without gradients.
    pub fn backward(&self) -> Result<GradStore> {
        let mut grads = self.loss.backward()?;
        self.expert_grads.drain_into(&mut grads)?;
        Ok(grads)
    }
}

pub struct MoeModel {
    config: ModelConfig,
    params: ParamStore,
    tok_emb: Var,
    /// The learned position table (None with rotary positions).
    pos_emb: Option<Var>,
    blocks: Vec<Block>,
    ln_f: Norm,
    head: Var,
    /// Block index of each MoE layer.
    moe_blocks: Vec<usize>,
    device: Device,
    dtype: DType,
    /// The dtype of the matrix products (bf16 for mixed precision): parameters, norms, softmaxes,
    /// the residual stream and the loss stay in `dtype` (f32), as PyTorch's autocast keeps them.
    compute: DType,
    /// Whether the layers run as Lazarus's GPU ops (a CUDA model with the kernels on): the
    /// products read the working copies below, outputs are written in the type the next layer
    /// reads, and no cast node enters the graph.
    gpu: bool,
    /// Per parameter (in [`ParamStore`] order), its bf16 working copy when the model computes in
    /// bf16 on a GPU and the parameter is a product's weight (rank 2, not an embedding): what
    /// the products read. The AdamW kernel refreshes each in its own pass
    /// ([`crate::AdamW::step_with_copies`]); [`MoeModel::refresh_working_copies`] makes them anew
    /// after the parameters were set any other way.
    working: Vec<Option<Tensor>>,
}

impl MoeModel {
    /// Build a model with weights drawn from `seed`.
    pub fn new(config: &ModelConfig, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        config.validate()?;
        let cfg = config.clone();
        let mut ps = ParamStore::default();
        let mut init = Init::new(seed, dtype, device.clone());
        let std = cfg.init_std;
        let tok_emb = ps.add("tok_emb".into(), init.normal(&[cfg.vocab_size, cfg.d_model], std)?)?;
        let pos_emb = match cfg.positions {
            Positions::Learned => Some(ps.add("pos_emb".into(), init.normal(&[cfg.max_seq_len, cfg.d_model], std)?)?),
            Positions::Rope => None,
        };
        let (d, norm) = (cfg.d_model, cfg.norm);
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        let mut moe_blocks = Vec::new();
        for b in 0..cfg.n_layers {
            let p = format!("blocks.{b}");
            let ln1 = Norm::new(&mut ps, &init, &format!("{p}.ln1"), d, norm, cfg.norm_eps)?;
            let attn = AttentionLayer::new(&mut ps, &mut init, &p, &cfg)?;
            let ln2 = Norm::new(&mut ps, &init, &format!("{p}.ln2"), d, norm, cfg.norm_eps)?;
            let ff = if cfg.is_moe(b) {
                moe_blocks.push(b);
                let gate = ps.add(format!("{p}.moe.gate.w"), init.normal(&[d, cfg.n_experts], std)?)?;
                // (Zero at first: the choice starts as the router's own.)
                let route_bias = match cfg.balance.uses_bias() {
                    true => Some(ps.add(format!("{p}.moe.gate.bias"), init.constant(&[cfg.n_experts], 0.0)?)?),
                    false => None,
                };
                let experts = (0..cfg.n_experts)
                    .map(|e| Ffn::new(&mut ps, &mut init, &format!("{p}.moe.experts.{e}"), &cfg, cfg.d_ff))
                    .collect::<Result<Vec<_>>>()?;
                let shared = match cfg.shared_experts {
                    0 => None,
                    s => Some(Ffn::new(&mut ps, &mut init, &format!("{p}.moe.shared"), &cfg, s * cfg.d_ff)?),
                };
                let shared_gate = match cfg.shared_expert_gate {
                    true => Some(ps.add(format!("{p}.moe.shared_gate.w"), init.normal(&[d, 1], std)?)?),
                    false => None,
                };
                FeedForward::Moe(MoeLayer {
                    gate,
                    route_bias,
                    experts,
                    shared,
                    shared_gate,
                    top_k: cfg.top_k,
                    router: cfg.router(),
                    act: cfg.expert_act,
                    capacity_factor: cfg.capacity_factor,
                })
            } else {
                FeedForward::Dense(Ffn::new(&mut ps, &mut init, &format!("{p}.ffn"), &cfg, cfg.dense_width())?)
            };
            blocks.push(Block { ln1, attn, ln2, ff });
        }
        let ln_f = Norm::new(&mut ps, &init, "ln_f", d, norm, cfg.norm_eps)?;
        let head = ps.add("head.w".into(), init.normal(&[cfg.d_model, cfg.vocab_size], std)?)?;
        Ok(MoeModel {
            config: cfg,
            params: ps,
            tok_emb,
            pos_emb,
            blocks,
            ln_f,
            head,
            moe_blocks,
            device: device.clone(),
            dtype,
            compute: dtype,
            gpu: gpu_kernels(device),
            working: Vec::new(),
        })
    }

    /// The block of each MoE layer, in order.
    pub fn moe_block_indices(&self) -> &[usize] {
        &self.moe_blocks
    }

    /// Whether the layers run as Lazarus's GPU ops (see the field).
    pub fn gpu_kernels(&self) -> bool {
        self.gpu
    }

    /// Make every working copy anew from its parameter (none unless the model computes in bf16
    /// with the GPU ops). Call after setting parameters other than by the optimizer's update.
    pub fn refresh_working_copies(&mut self) -> Result<()> {
        self.working.clear();
        if !(self.gpu && self.compute == DType::BF16) {
            return Ok(());
        }
        for (name, var) in self.params.iter() {
            let product = var.rank() == 2 && !name.ends_with("_emb");
            self.working.push(if product { Some(var.as_tensor().to_dtype(DType::BF16)?) } else { None });
        }
        Ok(())
    }

    /// The working copies, aligned with the parameters (empty when there are none): what the
    /// optimizer refreshes after each update.
    pub fn working_copies(&self) -> &[Option<Tensor>] {
        &self.working
    }

    /// The working copy of the parameter `var`, if it has one.
    fn copy_of(&self, var: &Var) -> Option<&Tensor> {
        if self.working.is_empty() {
            return None;
        }
        let i = self.params.vars().iter().position(|v| v.as_tensor().id() == var.as_tensor().id())?;
        self.working.get(i)?.as_ref()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Compute the matrix products in `compute` (e.g. bf16: mixed precision, the parameters and
    /// their gradients staying in [`MoeModel::dtype`]).
    pub fn with_compute_dtype(mut self, compute: DType) -> Result<Self> {
        self.compute = compute;
        self.refresh_working_copies()?;
        Ok(self)
    }

    /// The dtype of the matrix products.
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// Names of the tensors of expert `expert` in MoE layer `layer` (0-based over MoE layers):
    /// fc1.w, fc1.b, fc2.w, fc2.b, or fc1.w and fc2.w without FFN biases.
    pub fn expert_param_names(&self, layer: usize, expert: usize) -> Vec<String> {
        let b = self.moe_blocks[layer];
        let parts: &[&str] = if self.config.ffn_bias { &["fc1.w", "fc1.b", "fc2.w", "fc2.b"] } else { &["fc1.w", "fc2.w"] };
        parts.iter().map(|s| format!("blocks.{b}.moe.experts.{expert}.{s}")).collect()
    }

    /// Token + position embeddings: tokens [B, T] (u32) → x [B, T, d].
    pub fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        if t > self.config.max_seq_len {
            return Err(ModelError::config("seq_len", t, format!("longer than the model's max_seq_len ({})", self.config.max_seq_len)));
        }
        let d = self.config.d_model;
        let tok = self.tok_emb.as_tensor();
        let on_cores = tok.device().is_cpu() && matches!(tok.dtype(), DType::F32 | DType::F64);
        let Some(pos) = &self.pos_emb else {
            // Rotary positions: the attention turns q and k; the embedding is the token's row
            // (gathered by our kernels, on the cores or the GPU).
            if on_cores || self.gpu {
                let ids: Vec<u32> = tokens.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
                return Ok(crate::ops::gather_rows(tok, &ids)?.reshape((b, t, d))?);
            }
            return Ok(tok.index_select(&tokens.flatten_all()?, 0)?.reshape((b, t, d))?);
        };
        let pos = pos.as_tensor().narrow(0, 0, t)?;
        if on_cores {
            // Over the cores, forward and backward: each token's row and its position's row
            // gathered, then added. candle's index_select and broadcast add ran on one core, and
            // their backward summed the positions' gradient over the batch with a strided reduce,
            // also on one core. The gathers' backward adds each row back in row order (a position's
            // over the batch in batch order), as candle did: the same values.
            let ids: Vec<u32> = tokens.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
            let positions: Vec<u32> = (0..b * t).map(|r| (r % t) as u32).collect();
            let x = crate::ops::residual_add(&crate::ops::gather_rows(tok, &ids)?, &crate::ops::gather_rows(&pos, &positions)?)?;
            return Ok(x.reshape((b, t, d))?);
        }
        #[cfg(feature = "cuda")]
        if crate::ops::cuda::takes(tok) {
            let ids: Vec<u32> = tokens.flatten_all()?.to_dtype(DType::U32)?.to_vec1()?;
            return Ok(crate::ops::cuda::embed(tok, &pos, &ids, t)?.reshape((b, t, d))?);
        }
        Ok(tok.index_select(&tokens.flatten_all()?, 0)?.reshape((b, t, d))?.broadcast_add(&pos)?)
    }

    /// The attention half of block `block`: x [B, T, d] → (x + attn(ln1(x)), ln2 of that as
    /// [B·T, d]) — the residual stream and the feed-forward's input.
    pub fn block_attention(&self, block: usize, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t, d) = x.dims3()?;
        let blk = self.block(block)?;
        if let (true, AttentionLayer::Packed(attn)) = (self.gpu, &blk.attn) {
            // The norms write the products' type; the projection back onto the residual stream
            // writes its type (f32 from bf16 operands): no cast node.
            let c = self.compute;
            let a = blk.ln1.forward_to(x, c)?.reshape((b * t, d))?;
            let (qw, kvw) = attn.widths();
            let qkv = self.linear(&attn.qkv, &a, c)?.reshape((b, t, qw + 2 * kvw))?;
            let y = attn.attend(&qkv)?.reshape((b * t, qw))?;
            let o = self.linear(&attn.out, &y, x.dtype())?.reshape((b, t, d))?;
            let x = crate::ops::residual_add(x, &o)?;
            let h = blk.ln2.forward_to(&x, c)?.reshape((b * t, d))?;
            return Ok((x, h));
        }
        let x = crate::ops::residual_add(x, &blk.attn.forward(&blk.ln1.forward(x)?, self.compute)?)?;
        let h = blk.ln2.forward(&x)?.reshape((b * t, d))?;
        Ok((x, h))
    }

    /// The dense feed-forward of a non-MoE block on h [N, d] (None for an MoE block).
    pub fn block_dense_ffn(&self, block: usize, h: &Tensor) -> Result<Option<Tensor>> {
        match &self.block(block)?.ff {
            FeedForward::Dense(f) => Ok(Some(self.ffn_forward(f, h)?)),
            FeedForward::Moe(_) => Ok(None),
        }
    }

    /// The shared experts of an MoE block on h [N, d] (None for a block without them): what a
    /// worker adds to its distributed layer's output.
    pub fn block_shared_ffn(&self, block: usize, h: &Tensor) -> Result<Option<Tensor>> {
        match &self.block(block)?.ff {
            FeedForward::Moe(layer @ MoeLayer { shared: Some(f), .. }) => Ok(Some(layer.gate_shared(h, self.ffn_forward(f, h)?)?)),
            _ => Ok(None),
        }
    }

    /// A dense FFN (a non-MoE block's, or the shared experts) on this model's path: on the GPU
    /// ops from h in the products' type into the residual stream's, else in h's type.
    fn ffn_forward(&self, f: &Ffn, h: &Tensor) -> Result<Tensor> {
        if self.gpu {
            return f.forward_gpu(self, h, self.dtype);
        }
        f.forward(h, self.compute)
    }

    /// Router weight [d, E] of MoE layer `layer` (0-based over MoE layers).
    pub fn gate(&self, layer: usize) -> Result<&Var> {
        match self.moe_blocks.get(layer).map(|&b| &self.blocks[b].ff) {
            Some(FeedForward::Moe(m)) => Ok(&m.gate),
            _ => Err(ModelError::config("moe layer", layer, format!("the model has {} MoE layers", self.moe_blocks.len()))),
        }
    }

    /// The routing bias of MoE layer `layer` (None without loss-free balancing).
    pub fn route_bias(&self, layer: usize) -> Result<Option<&Var>> {
        match self.moe_blocks.get(layer).map(|&b| &self.blocks[b].ff) {
            Some(FeedForward::Moe(m)) => Ok(m.route_bias.as_ref()),
            _ => Err(ModelError::config("moe layer", layer, format!("the model has {} MoE layers", self.moe_blocks.len()))),
        }
    }

    /// The tensors of one expert of MoE layer `layer`, in [`MoeModel::expert_param_names`]
    /// order: (W1, b1, W2, b2), or (W1, W2) without FFN biases.
    pub fn expert_vars(&self, layer: usize, expert: usize) -> Result<Vec<Var>> {
        match self.moe_blocks.get(layer).map(|&b| &self.blocks[b].ff) {
            Some(FeedForward::Moe(m)) => match m.experts.get(expert) {
                Some(f) => Ok(f.vars()),
                None => Err(ModelError::config("expert", expert, format!("the layer has {} experts", m.experts.len()))),
            },
            _ => Err(ModelError::config("moe layer", layer, format!("the model has {} MoE layers", self.moe_blocks.len()))),
        }
    }

    /// Whether expert `expert` of MoE layer `layer` has its weights in this process (a worker
    /// keeps only the experts placed on it; see [`MoeModel::set_expert`]).
    pub fn expert_resident(&self, layer: usize, expert: usize) -> Result<bool> {
        Ok(self.expert_vars(layer, expert)?[0].elem_count() > 0)
    }

    /// Shapes of an expert's tensors in this model ([`ModelConfig::expert_shapes`]).
    pub fn expert_shapes(&self) -> Vec<Vec<usize>> {
        self.config.expert_shapes()
    }

    /// The activation of the experts.
    pub fn expert_act(&self) -> Activation {
        self.config.expert_act
    }

    /// Give expert `expert` of MoE layer `layer` the weights of [`MoeModel::expert_vars`] (shapes checked
    /// against the config), or release them (`None`: each tensor becomes an empty placeholder,
    /// freeing its memory). The parameter list keeps its names and order, so optimizer state and
    /// checkpoints stay aligned; a released expert cannot run and must be given weights again
    /// before it is saved.
    pub fn set_expert(&mut self, layer: usize, expert: usize, weights: Option<Vec<Tensor>>) -> Result<()> {
        let names = self.expert_param_names(layer, expert);
        let indices: Vec<usize> = names
            .iter()
            .map(|n| self.params.position(n).ok_or_else(|| ModelError::config("expert tensor", n, "is not a parameter of the model")))
            .collect::<Result<_>>()?;
        let vars: Vec<Var> = match weights {
            Some(ws) => {
                let shapes = self.expert_shapes();
                if ws.len() != shapes.len() {
                    return Err(ModelError::config("expert tensors", ws.len(), format!("the model's experts have {}", shapes.len())));
                }
                ws.iter()
                    .zip(shapes)
                    .zip(&names)
                    .map(|((t, shape), name)| {
                        if t.dims() != shape.as_slice() {
                            return Err(ModelError::config(
                                "expert tensor",
                                format!("{name} {:?}", t.dims()),
                                format!("expected {shape:?}"),
                            ));
                        }
                        Ok(Var::from_tensor(&t.to_dtype(self.dtype)?.to_device(&self.device)?)?)
                    })
                    .collect::<Result<_>>()?
            }
            None => (0..names.len()).map(|_| Ok(Var::from_tensor(&Tensor::zeros(0, self.dtype, &self.device)?)?)).collect::<Result<_>>()?,
        };
        let b = self.moe_blocks[layer];
        let FeedForward::Moe(m) = &mut self.blocks[b].ff else {
            return Err(ModelError::config("moe layer", layer, "is not an MoE layer"));
        };
        let x = &mut m.experts[expert];
        for (i, v) in indices.iter().zip(&vars) {
            self.params.replace(*i, v.clone());
            if let Some(slot) = self.working.get_mut(*i) {
                if slot.is_some() {
                    *slot = Some(v.as_tensor().to_dtype(DType::BF16)?);
                }
            }
        }
        let mut vars = vars.into_iter();
        let mut next = || vars.next().ok_or_else(|| ModelError::config("expert", expert, "too few tensors"));
        x.fc1.w = next()?;
        if x.fc1.b.is_some() {
            x.fc1.b = Some(next()?);
        }
        x.fc2.w = next()?;
        if x.fc2.b.is_some() {
            x.fc2.b = Some(next()?);
        }
        Ok(())
    }

    /// The loss-free balancing's step ([`crate::routing::update_route_bias`]): each MoE layer's
    /// routing bias moved toward its mean load, `loads` one list per MoE layer (the step's whole
    /// global batch). Nothing without the bias.
    pub fn update_route_biases(&self, loads: &[Vec<u64>]) -> Result<()> {
        let rate = self.config.bias_update_rate;
        let layers = self.blocks.iter().filter_map(|b| match &b.ff {
            FeedForward::Moe(m) => Some(m),
            FeedForward::Dense(_) => None,
        });
        for (m, load) in layers.zip(loads) {
            let Some(var) = &m.route_bias else { continue };
            let mut bias: Vec<f64> = var.as_tensor().to_dtype(DType::F64)?.to_vec1()?;
            crate::routing::update_route_bias(&mut bias, load, rate);
            var.set(&Tensor::from_vec(bias, load.len(), var.device())?.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }

    /// Block index of each MoE layer.
    pub fn moe_blocks(&self) -> &[usize] {
        &self.moe_blocks
    }

    /// Final norm and head: x [B, T, d] → logits [B·T, V].
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let c = self.compute;
        if self.gpu {
            let a = self.ln_f.forward_to(x, c)?.reshape((b * t, d))?;
            return Ok(crate::ops::cuda_linear(&a, &self.head, None, self.copy_of(&self.head), x.dtype())?);
        }
        Ok(self.ln_f.forward(x)?.reshape((b * t, d))?.to_dtype(c)?.matmul(&self.head.as_tensor().to_dtype(c)?)?.to_dtype(x.dtype())?)
    }

    /// An MoE layer's forward on this model's path (the GPU ops, or the CPU kernels and
    /// candle's composites).
    fn moe_forward(&self, m: &MoeLayer, h: &Tensor, forced: Option<&[f64]>, sink: &WeightGradSink) -> Result<(Tensor, Tensor, MoeStats)> {
        #[cfg(feature = "cuda")]
        if self.gpu {
            return m.forward_gpu(self, h, forced, sink);
        }
        m.forward(h, forced, sink, self.compute)
    }

    /// A linear layer on the GPU path: its product reads the weight's working copy, if it has
    /// one, and writes `out`.
    fn linear(&self, l: &Linear, x: &Tensor, out: DType) -> Result<Tensor> {
        Ok(crate::ops::cuda_linear(x, &l.w, l.b.as_ref(), self.copy_of(&l.w), out)?)
    }

    fn block(&self, block: usize) -> Result<&Block> {
        self.blocks.get(block).ok_or_else(|| ModelError::config("block", block, format!("the model has {} blocks", self.blocks.len())))
    }

    /// Forward pass over tokens [B, T] with next-token targets [B, T]. `forced_loads` (per MoE
    /// layer, per expert) replaces the router's choices (trace-driven routing).
    pub fn forward(&self, tokens: &Tensor, targets: &Tensor, forced_loads: Option<&[Vec<f64>]>) -> Result<ForwardOutput> {
        let (b, t) = tokens.dims2()?;
        let cfg = &self.config;
        let d = cfg.d_model;
        let mut x = self.embed(tokens)?;
        let mut aux_total: Option<Tensor> = None;
        let mut moe = Vec::new();
        let expert_grads = WeightGradSink::new();
        for (i, block) in self.blocks.iter().enumerate() {
            let (x_mid, h) = self.block_attention(i, &x)?;
            let y = match &block.ff {
                FeedForward::Dense(f) => self.ffn_forward(f, &h)?,
                FeedForward::Moe(m) => {
                    let forced = forced_loads.and_then(|f| f.get(moe.len())).map(Vec::as_slice);
                    let (y, aux, stats) = self.moe_forward(m, &h, forced, &expert_grads)?;
                    aux_total = Some(match aux_total {
                        Some(a) => (a + aux)?,
                        None => aux,
                    });
                    moe.push(stats);
                    y
                }
            };
            x = crate::ops::residual_add(&x_mid, &y.reshape((b, t, d))?.to_dtype(x_mid.dtype())?)?;
        }
        let logits = self.logits(&x)?;
        let ce_loss = cross_entropy(&logits, &targets.flatten_all()?)?;
        let aux_loss = match aux_total {
            Some(a) => (a / moe.len() as f64)?,
            None => Tensor::zeros((), self.dtype, &self.device)?,
        };
        let loss = (&ce_loss + (&aux_loss * cfg.aux_weight())?)?;
        Ok(ForwardOutput { ce_loss, aux_loss, loss, moe, logits, expert_grads })
    }
}

/// Whether a model on `device` runs its layers as Lazarus's GPU ops.
fn gpu_kernels(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        device.is_cuda() && crate::ops::cuda::enabled()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// Mean cross-entropy of logits [N, V] against targets [N] (u32): one fused node (see
/// [`crate::ops::cross_entropy`]).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(crate::ops::cross_entropy(logits, &targets.flatten_all()?.to_vec1::<u32>()?)?)
}

#[cfg(test)]
mod tests;
