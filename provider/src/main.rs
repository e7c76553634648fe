//! terraform-provider-lbscale: Terraform plugin protocol 6, on the tf-provider crate.

mod azure_block;
mod common;
mod data_sources;
mod gcp_block;
mod nodelay;
mod provider;
mod resources;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // tf-provider captures a backtrace into every diagnostic whenever RUST_BACKTRACE
    // is set (it is, on many machines), and Terraform then reports a provider crash.
    // RUST_LIB_BACKTRACE=0 turns off library backtrace capture while panics still
    // honour RUST_BACKTRACE. Our own diagnostics never capture one (common::diag).
    // Set before any other thread starts.
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    nodelay::before_handshake();
    tf_provider::serve("lbscale", provider::LbscaleProvider::default()).await
}
