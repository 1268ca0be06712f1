// Package closerproc is the process side of the pre-flight's socket closer
// (preflight.ExecCloser): a copy of the plugin binary started with Env set
// holds the packet sockets it is sent on descriptor FD until the plugin
// exits, then exits itself, so that the kernel's close-time RCU grace
// period is paid outside the runtime's wait.
//
// The closer runs from this package's init and exits there. Go initialises
// packages in import-path order as soon as their imports are initialised;
// this package imports only syscall and time and sorts before every
// standard and third-party package, so a closer starts holding sockets
// without running the plugin's other package initialisers (net/http,
// crypto, netlink, CNI types: most of a plugin process's start-up CPU). A
// process without Env set returns from init at once.
package closerproc
