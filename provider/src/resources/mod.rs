//! The four resources. Each keeps its Terraform state shape here and hands the
//! work to the engine; no decision logic lives in the provider. The Terraform
//! plumbing they share is [`managed::Managed`].

pub mod distributor;
pub mod group;
pub mod managed;
pub mod memo;
pub mod se_group;
pub mod vserver;

use tf_provider::Diagnostics;

/// Refuses, at plan time rather than apply, clouds that have no driver in this
/// provider and a cloud whose settings are missing (`nodes`: the `node` block
/// of a group, whose nodes need more, such as an aws image).
pub fn check_cloud_usable(
    engine: &crate::common::EngineHandle,
    diags: &mut Diagnostics,
    cloud: Option<&String>,
    nodes: Option<&lbscale_engine::model::NodeSpec>,
) -> Option<()> {
    let at = || tf_provider::AttributePath::new("cloud");
    let unusable = |e: &lbscale_engine::Engine, c: &str| match nodes {
        Some(node) => e.node_unusable(c, node),
        None => e.cloud_unusable(c, false),
    };
    match cloud.map(String::as_str) {
        Some(c) => match engine.get().and_then(|e| unusable(e, c)) {
            Some(why) => {
                let summary = match why {
                    lbscale_engine::cloud::CloudError::NoDriver { .. } => {
                        "Cloud driver not built yet"
                    }
                    _ => "Cloud not usable",
                };
                crate::common::error(diags, at(), summary, why.to_string());
                None
            }
            None => Some(()),
        },
        None => Some(()),
    }
}
