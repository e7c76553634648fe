fn main() -> Result<(), Box<dyn std::error::Error>> {
    // protoc and its well-known types come from the protoc-bin-vendored crate
    // (pinned in Cargo.lock), so the build needs no system protoc. tf-provider's
    // build script reads PROTOC instead: .cargo/config.toml points it at the copy
    // of the same binary that scripts/setup.sh puts in .tools/protoc.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=proto/node.proto");
    tonic_build::configure().compile_protos(&["proto/node.proto"], &["proto"])?;
    Ok(())
}
