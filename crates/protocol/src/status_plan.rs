//! The plan as a status reply carries it ([`proto::Plan`]): every layer's experts on each node.
//! The client rebuilds a [`ModelPlan`] from it through the plan file's own checks, so a reply
//! that is no plan is refused as a plan file with the same faults would be.

use lazarus_plan::{ClusterShape, ModelPlan, PlanError, PlanFile, PlanFileLayer, PLAN_FORMAT};

use crate::proto;

pub fn plan_to_proto(plan: &ModelPlan) -> proto::Plan {
    let shape = plan.shape();
    proto::Plan {
        epoch: plan.epoch(),
        nodes: shape.nodes as u64,
        gpus_per_node: shape.gpus_per_node as u64,
        slots_per_gpu: shape.slots_per_gpu as u64,
        experts: plan.experts() as u64,
        layers: plan
            .layers()
            .iter()
            .map(|p| proto::PlanLayer {
                nodes: p.nodes().iter().map(|e| proto::Ids { ids: e.iter().map(|&x| x as u64).collect() }).collect(),
            })
            .collect(),
    }
}

/// The plan a status reply carries, checked as a plan file is.
pub fn plan_from_proto(plan: &proto::Plan) -> Result<ModelPlan, PlanError> {
    let word = |field: &'static str, n: u64| {
        usize::try_from(n).map_err(|_| PlanError::Invalid { field, value: n.to_string(), reason: "beyond this machine's words".into() })
    };
    let shape = ClusterShape {
        nodes: word("nodes", plan.nodes)?,
        gpus_per_node: word("gpus_per_node", plan.gpus_per_node)?,
        slots_per_gpu: word("slots_per_gpu", plan.slots_per_gpu)?,
    };
    let layers = plan
        .layers
        .iter()
        .map(|l| {
            let placement = l.nodes.iter().map(|n| n.ids.iter().map(|&e| word("layers", e)).collect()).collect::<Result<_, _>>()?;
            Ok(PlanFileLayer {
                strategy: None,
                loads: None,
                replicas: None,
                applied_floor: None,
                placement,
                imbalance: None,
                recovery: None,
            })
        })
        .collect::<Result<_, PlanError>>()?;
    let file = PlanFile {
        format: PLAN_FORMAT.into(),
        epoch: plan.epoch,
        shape,
        experts: word("experts", plan.experts)?,
        layers,
        model_recovery: None,
    };
    ModelPlan::from_file(&file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_goes_through_a_status_reply_and_comes_back_the_same() {
        let plan = ModelPlan::from_json(
            r#"{"format":"lazarus-plan/1","epoch":7,"shape":{"nodes":2,"gpus_per_node":1,"slots_per_gpu":3},"experts":4,
                "layers":[{"placement":[[0,1,2],[3,0,1]]},{"placement":[[1,2,3],[0,2,3]]}]}"#,
        )
        .unwrap();
        let back = plan_from_proto(&plan_to_proto(&plan)).unwrap();
        assert_eq!(back.to_json(), plan.to_json());
        let mut bad = plan_to_proto(&plan);
        bad.layers[0].nodes[1].ids = vec![3, 99, 0];
        assert!(plan_from_proto(&bad).unwrap_err().to_string().contains("layer 0"));
        bad.experts = u64::MAX;
        assert!(plan_from_proto(&bad).is_err());
    }
}
