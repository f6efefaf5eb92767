// Package config reads mrfs's config.toml: the schema, its defaults, size
// and access parsing, and validation.
//
// Decoding is strict so that a typo never silently falls back to a default:
// unknown keys (and keys in the wrong case) are errors. Every key has a
// default, so an empty file is valid. All errors from Load, Parse and
// Validate are config errors: they match ErrInvalid with errors.Is and
// *Error with errors.As, which is how the CLI picks exit code 2.
//
// Set applies one key from its text form, as a mount option (`-o
// buffers.max_pinned=1GiB`) gives it, through the same decoding; Keys
// lists the keys for the command line's documentation.
//
// Value formats:
//
//   - Sizes (buffers.default_size, buffers.max_pinned,
//     remote.max_message_size) are a non-negative
//     TOML integer of bytes, or a string: a whole number with an optional
//     unit B, KiB, MiB, GiB, TiB, PiB or EiB (powers of 1024, any case,
//     optional space: "64KiB", "1 GiB"). KB/MB/GB and K/M/G are rejected
//     because readers disagree on whether they mean 1000 or 1024, and
//     fractions ("1.5MiB") are rejected so that a size is exactly what is
//     written.
//   - Access lists (buffers.default_access, buffers.allowed_access) are an
//     array whose elements are access names or masks, as verbs.ParseAccess
//     reads them (["local_write", "remote_read"], ["0x5"], [5]), or one
//     such string ("local_write,remote_read").
//   - mount.umask is a string of octal digits ("077", "0o022"). A TOML
//     integer is refused: `umask = 22` would be decimal 22 (octal 026), a
//     silent weakening of key secrecy, and the decoder cannot tell 0o22
//     from 18.
//   - Enumerations (verbs.backend, log.level, log.format) are lower case.
//   - log.output is "stderr", "syslog" or an absolute path: a daemon in
//     the background works in /, where a relative path would mislead.
//   - remote.listen is "host:port" with an IP literal or empty host;
//     remote.allow_from is a list of CIDR networks or single addresses;
//     remote.timeout is a quoted Go duration ("10s"), never a bare number.
package config
