pub mod audit_cli;
