"""The built-in measures: one module per family, each registering its measures with
`flatbench.measures.plugin.register_measure` exactly as an outside plugin does. Every module of this
package is imported when the registry is first read."""
