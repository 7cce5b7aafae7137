//! Bootstrap: the authenticated TCP key-value store and launcher-environment detection.
