package proxytest
