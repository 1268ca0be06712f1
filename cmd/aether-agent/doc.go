// Command aether-agent is the aether node agent; see agent/README.md.
package main
