fn main() -> Result<(), Box<dyn std::error::Error>> {
    // protoc comes from the system (scripts/setup.sh installs Debian's
    // protobuf-compiler): tf-provider's own build needs it too.
    println!("cargo:rerun-if-changed=proto/node.proto");
    tonic_build::configure().compile_protos(&["proto/node.proto"], &["proto"])?;
    Ok(())
}
