"""Code the tests share: factories, reference implementations, run helpers. No test file
imports another test file; what two of them need lives here."""
