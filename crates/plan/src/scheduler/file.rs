//! The one file format of a plan: what `lazarus plan` prints in JSON, and what `lazarus prob
//! --placement-file`, `lazarus train --placement-file` and the controller's messages read.
//!
//! ```json
//! {"format": "lazarus-plan/1", "epoch": 0,
//!  "shape": {"nodes": 4, "gpus_per_node": 1, "slots_per_gpu": 4}, "experts": 8,
//!  "layers": [{"placement": [[0, 1, 2, 3], ...], "replicas": [...], "recovery": [...], ...}]}
//! ```
//!
//! `placement` has one array per node with G·c expert ids, GPU by GPU. The other fields of a
//! layer (`strategy`, `loads`, `replicas`, `applied_floor`, `imbalance`, `recovery`) report how
//! the plan was made; on reading they are checked for consistency where they constrain the plan
//! (`replicas`, `loads`) and otherwise ignored.

use serde::{Deserialize, Serialize};

use super::ModelPlan;
use crate::error::PlanError;
use crate::placement::{ClusterShape, Placement, Strategy};
use crate::recovery::RecoveryEstimate;
use crate::ExpertId;

/// The `format` field of every plan file.
pub const PLAN_FORMAT: &str = "lazarus-plan/1";

/// A plan file as written and read (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub format: String,
    pub epoch: u64,
    pub shape: ClusterShape,
    pub experts: usize,
    pub layers: Vec<PlanFileLayer>,
    /// Probability that the whole model recovers (every layer at once), k = 0..N−1 failed nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_recovery: Option<Vec<RecoveryEstimate>>,
}

/// One layer of a [`PlanFile`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFileLayer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loads: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_floor: Option<usize>,
    pub placement: Vec<Vec<ExpertId>>,
    /// With loads: the busiest GPU's least possible tokens over the mean (balanced dispatcher).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imbalance: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Vec<RecoveryEstimate>>,
}

impl PlanFileLayer {
    /// A layer entry with only its placement (add the report fields as wanted).
    pub fn of(placement: &Placement) -> Self {
        PlanFileLayer {
            strategy: None,
            loads: None,
            replicas: None,
            applied_floor: None,
            placement: placement.nodes().to_vec(),
            imbalance: None,
            recovery: None,
        }
    }
}

impl ModelPlan {
    /// The plan as a file, with no report fields.
    pub fn to_file(&self) -> PlanFile {
        PlanFile {
            format: PLAN_FORMAT.into(),
            epoch: self.epoch(),
            shape: self.shape(),
            experts: self.experts(),
            layers: self.layers().iter().map(PlanFileLayer::of).collect(),
            model_recovery: None,
        }
    }

    /// A validated plan from a file's parsed contents.
    pub fn from_file(file: &PlanFile) -> Result<Self, PlanError> {
        if file.format != PLAN_FORMAT {
            return Err(PlanError::invalid("format", format!("{:?}", file.format), format!("expected {PLAN_FORMAT:?}")));
        }
        let s = file.shape;
        let shape = ClusterShape::new(s.nodes, s.gpus_per_node, s.slots_per_gpu)?;
        if file.experts == 0 || file.experts > shape.total_slots() {
            return Err(PlanError::invalid(
                "experts",
                file.experts,
                format!("must be between 1 and the {} replica slots of the cluster", shape.total_slots()),
            ));
        }
        let mut layers = Vec::with_capacity(file.layers.len().min(1 << 16));
        for (l, layer) in file.layers.iter().enumerate() {
            let in_layer = |e: PlanError| PlanError::invalid("layers", format!("layer {l}"), e.to_string());
            let p = Placement::from_nodes(shape, file.experts, layer.placement.clone()).map_err(in_layer)?;
            if let Some(r) = &layer.replicas {
                if *r != p.replica_counts() {
                    return Err(in_layer(PlanError::invalid(
                        "replicas",
                        format!("{r:?}"),
                        format!("the placement holds {:?}", p.replica_counts()),
                    )));
                }
            }
            if let Some(loads) = &layer.loads {
                if loads.len() != file.experts {
                    return Err(in_layer(PlanError::Length { field: "loads", got: loads.len(), expected: file.experts }));
                }
            }
            layers.push(p);
        }
        ModelPlan::new(file.epoch, layers)
    }

    /// Parse and validate the JSON of a plan file.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        let file: PlanFile = serde_json::from_str(text).map_err(|e| {
            PlanError::invalid(
                "plan file",
                format!("line {} column {}", e.line(), e.column()),
                format!("{e}; expected a plan file, as `lazarus plan` prints it in JSON: {{\"format\":\"{PLAN_FORMAT}\",\"epoch\":…,\"shape\":{{…}},\"experts\":…,\"layers\":[{{\"placement\":[[expert ids] per node]}}]}}"),
            )
        })?;
        ModelPlan::from_file(&file)
    }

    /// The plan file as JSON (no report fields).
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.to_file()).unwrap_or_default()
    }
}
