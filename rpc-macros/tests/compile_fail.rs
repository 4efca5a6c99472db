//! Every misuse of `#[service]`, and a raw handler of the wrong shape, is a compile error with a
//! readable message at the right span:
//! tests/ui/*.rs, each with its committed `.stderr` (regenerate with `TRYBUILD=overwrite`).

#[test]
fn misuses_of_service_are_spanned_compile_errors() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
