//! The four resources. Each keeps its Terraform state shape here and hands the
//! work to the engine; no decision logic lives in the provider. The Terraform
//! plumbing they share is [`managed::Managed`].

pub mod distributor;
pub mod group;
pub mod managed;
pub mod se_group;
pub mod vserver;

use tf_provider::Diagnostics;

/// Refuses clouds whose driver is not built yet, at plan time rather than apply.
pub fn check_cloud_built(diags: &mut Diagnostics, cloud: Option<&String>) -> Option<()> {
    match cloud.map(String::as_str) {
        Some("azure") | Some("gcp") => {
            crate::common::error(
                diags,
                tf_provider::AttributePath::new("cloud"),
                "Cloud driver not built yet",
                format!("the {} cloud driver is not built yet in this version of lbscale; \"local\" and \"aws\" work", cloud.unwrap()),
            );
            None
        }
        _ => Some(()),
    }
}
