//! Harness for driving Terraform; see tests/.
