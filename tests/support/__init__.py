"""What the tests share: launching real process groups (`harness`), the functions ranks run (`workers`,
`hf_workers`, `convert_support`), the plain single-process AdamW reference (`reference`) and text
fixtures. No tests live here."""
